"""Results use Parquet nulls for "not applicable"; DuckDB and polars agree with pandas."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tests.replay_fixtures import build_store
from tracesim.app.cli import main as cli_main
from tracesim.columns import DESCRIPTION_KEY, nullify_rows, to_arrow


@pytest.fixture(scope="module")
def results_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("nulls")
    store = build_store(root / "store", n_layers=1, n_seqs=2, o_proj=False)
    out = root / "res"
    code = cli_main(["replay", str(store), "--score", "snapkv,full", "--design",
                     "topk,poisson", "--budget", "0.4", "--seeds", "3", "--window", "8",
                     "--per-seed", "--no-progress", "--out", str(out)])
    assert code == 0
    return out


def test_no_nan_or_sentinels_and_every_column_described(results_file):
    from tracesim.dataset_read import read_results

    table = read_results(results_file)
    for field in table.schema:
        desc = (field.metadata or {}).get(DESCRIPTION_KEY, b"")
        assert desc.strip(), f"column {field.name!r} has no description"
        if pa.types.is_floating(field.type):
            assert not pc.any(pc.is_nan(table[field.name])).as_py(), field.name
    df = table.to_pandas()
    assert (df["seed"].dropna() >= 0).all() and df["seed"].isna().any()
    assert df.loc[df.design == "topk", "cert2"].isna().all()
    assert df.loc[df.score == "full", "budget"].isna().all()
    assert df["design_kind"].isna().all() and df["every"].isna().all()
    assert df["layer_err2"].isna().all()  # no o_proj in this store
    meta = pq.read_metadata(results_file / "results" / "parts" / "part-00000.parquet")
    idx = table.schema.get_field_index("cert2")
    assert meta.row_group(0).column(idx).statistics.null_count > 0


def test_duckdb_and_polars_aggregates_equal_pandas(results_file):
    duckdb = pytest.importorskip("duckdb")
    pl = pytest.importorskip("polars")
    from tracesim.dataset_read import read_results

    df = read_results(results_file).to_pandas()
    cols = ["wald_cov", "cert2", "err2", "rel_err", "sat_cov", "seed"]
    want = {c: df[c].mean() for c in cols}
    counts = {c: int(df[c].count()) for c in cols}
    # the results dataset's parts, read directly by each engine's own reader
    path = str(results_file / "results" / "parts" / "*.parquet").replace("'", "''")
    con = duckdb.connect()
    sql = ", ".join(f"avg({c}), count({c})" for c in cols)
    row = con.execute(f"SELECT {sql} FROM read_parquet('{path}')").fetchone()
    lazy = pl.read_parquet(results_file / "results" / "parts" / "*.parquet")
    for i, c in enumerate(cols):
        d_avg, d_count = row[2 * i], row[2 * i + 1]
        p_avg, p_count = lazy[c].mean(), lazy[c].count()
        assert d_count == p_count == counts[c], c
        if counts[c] == 0:
            assert d_avg is None and p_avg is None
        else:
            assert d_avg == pytest.approx(want[c], rel=1e-12), c
            assert p_avg == pytest.approx(want[c], rel=1e-12), c
    # isnan finds nothing: "not applicable" is null, not NaN.
    n_nan = con.execute(f"SELECT count(*) FROM read_parquet('{path}') "
                        "WHERE isnan(wald_cov) OR isnan(cert2)").fetchone()[0]
    assert n_nan == 0


def test_generic_builders_turn_nan_and_sentinels_into_nulls():
    arr = to_arrow("new_metric", np.array([1.0, np.nan, 3.0]))
    assert arr.null_count == 1 and arr.to_pylist() == [1.0, None, 3.0]
    assert to_arrow("seed", np.array([-1, 4])).to_pylist() == [None, 4]
    t = nullify_rows([{"seed": -1, "answer": "", "design_kind": "", "x": float("nan"),
                       "certificate_by_layer": []},
                      {"seed": 2, "answer": "a", "design_kind": "pareto", "x": 1.0,
                       "certificate_by_layer": [0.5]}])
    assert t.to_pylist()[0] == {"seed": None, "answer": "", "design_kind": None, "x": None,
                                "certificate_by_layer": None}
    assert all((f.metadata or {}).get(DESCRIPTION_KEY) is not None for f in t.schema)


@pytest.mark.parametrize("typ", [pa.float64(), pa.float32(), pa.int64(), pa.int32(), pa.bool_(),
                                 pa.string()])
def test_buffer_built_arrays_equal_pa_array(typ):
    """The pandas-free fast path of to_arrow gives exactly what pa.array gives."""
    rng = np.random.default_rng(3)
    n = 257
    if pa.types.is_string(typ):
        pool = np.array(["snapkv", "", None, "é-ü", "poisson"], dtype=object)
        values = np.repeat(pool[rng.integers(0, pool.size, 40)], rng.integers(1, 12, 40))
        for name in ("score", "task"):  # "" is a value in one, null in the other
            expected = [None if v is None or (v == "" and name == "task") else v
                        for v in values]
            got = to_arrow(name, values, typ)
            got.validate(full=True)
            assert got.equals(pa.array(expected, type=typ))
        return
    if pa.types.is_boolean(typ):
        values = rng.random(n) < 0.5
        expected = pa.array(values.tolist(), type=typ)
    elif pa.types.is_floating(typ):
        values = rng.normal(size=n)
        values[rng.random(n) < 0.2] = np.nan
        expected = pa.array([None if np.isnan(v) else v for v in values], type=typ)
    else:
        values = rng.integers(-3, 1000, n)
        values[rng.random(n) < 0.2] = -1
        expected = pa.array([None if v == -1 else int(v) for v in values], type=typ)
    got = to_arrow("seed", values, typ)
    got.validate(full=True)
    assert got.equals(expected)
    with pytest.raises(pa.ArrowInvalid):
        to_arrow("x", np.array([2**40]), pa.int32())  # out of range still refused
