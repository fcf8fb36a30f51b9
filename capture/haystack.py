"""Filler text and word lists for the generated tasks (written for this project, plain data)."""

from __future__ import annotations

#: The classic passkey filler.
PASSKEY_NOISE = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)

#: Neutral prose sentences; sampled with replacement to build haystacks.
SENTENCES: tuple[str, ...] = (
    "The old bridge over the river was repaired last spring after a long winter.",
    "Most visitors arrive in the morning, when the light over the hills is soft.",
    "A small bakery on the corner sells bread that is still warm at seven o'clock.",
    "The committee met twice before agreeing on a date for the annual fair.",
    "Farmers in the valley grow wheat, barley and a little rye on the higher fields.",
    "The library keeps its oldest maps in a cool room at the end of the hall.",
    "Every summer the town paints the benches along the harbour a fresh shade of blue.",
    "The train to the coast leaves on the hour and takes a little under two hours.",
    "Children from the village school planted a row of apple trees near the gate.",
    "The museum added a new wing for tools and machines from the last century.",
    "A narrow path climbs from the church to a viewpoint above the lake.",
    "The weather report promised rain, but the afternoon stayed dry and bright.",
    "Workers replaced the roof tiles of the town hall one section at a time.",
    "The market opens on Saturdays and sells cheese, honey, fish and vegetables.",
    "An old lighthouse stands on the rocks, no longer used but carefully kept.",
    "The choir practices on Thursday evenings in the room above the post office.",
    "A long table in the kitchen was made from the wood of a fallen oak.",
    "The mountain road closes in winter when snow covers the upper bends.",
    "Two fishing boats came back late, their nets heavy with the evening catch.",
    "The garden behind the house has roses, mint and a crooked pear tree.",
    "On clear nights the hill behind the farm is a good place to watch the stars.",
    "The company moved its offices to a brick building near the station.",
    "A local writer published a short history of the mill and its owners.",
    "The river floods the low meadows every few years after heavy spring rain.",
    "Students repaired the old clock in the square as part of a summer project.",
    "The ferry carries cars, bicycles and the occasional flock of sheep.",
    "A quiet café near the park serves soup and sandwiches until late afternoon.",
    "The forest trail is marked with small wooden posts painted white at the top.",
    "Builders found old coins while digging the foundations of the new school.",
    "The festival ends each year with music in the square and a lantern walk.",
    "A steady wind from the west keeps the island cool even in August.",
    "The hospital opened a small garden where patients can sit in the sun.",
    "Several families keep bees on the slope behind the orchard.",
    "The town council voted to widen the pavement along the main street.",
    "An orchestra from the city gives a free concert in the park each June.",
    "The cheese is aged for a year in caves cut into the limestone cliff.",
    "A flock of geese crosses the marsh every autumn on its way south.",
    "The carpenter's workshop smells of pine and linseed oil.",
    "The bus stops at the crossroads three times a day, except on Sundays.",
    "A stone wall runs along the edge of the field, older than anyone can remember.",
    "The post office still sells stamps with pictures of the local birds.",
    "In the evening the fishermen mend their nets on the quay.",
    "The new swimming pool will open once the last tests are complete.",
    "A painter rented the attic room because of the light from the north window.",
    "The valley is known for its thick fog on autumn mornings.",
    "The school library received a box of donated books about sailing.",
    "A narrow canal connects the two lakes and is used by small boats.",
    "The chapel on the hill is open to visitors on the first Sunday of the month.",
)

#: Adjectives and nouns for word-pair keys (multikey, kvret).
ADJECTIVES: tuple[str, ...] = (
    "amber", "brave", "calm", "dusty", "eager", "fuzzy", "gentle", "hollow", "icy", "jolly",
    "keen", "lively", "misty", "noble", "olive", "proud", "quiet", "rapid", "silent", "tidy",
    "upper", "vivid", "windy", "young", "zesty", "bold", "crisp", "dark", "empty", "fancy",
)
NOUNS: tuple[str, ...] = (
    "anchor", "badger", "candle", "dolphin", "engine", "falcon", "garden", "harbor", "island",
    "jacket", "kettle", "ladder", "meadow", "needle", "orchard", "pepper", "quarry", "rabbit",
    "saddle", "tunnel", "valley", "walnut", "yacht", "zebra", "basket", "castle", "desert",
    "feather", "glacier", "hammer",
)
