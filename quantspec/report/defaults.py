"""Built-in inputs of a report when the user gives none: prompts, calibration text, held-out text.

The three texts are disjoint (no paragraph of one appears in another), so the perplexity is
measured on text that neither calibration nor the prompts have seen. They are small on purpose:
the default report must finish within 20 minutes on 2 CPU cores.
"""

from __future__ import annotations

__all__ = ["DEFAULT_PROMPTS", "DEFAULT_CALIB_TEXT", "DEFAULT_EVAL_TEXT"]

# Eight short prompts of the kinds people send to a small instruct model: facts, lists, code,
# rewriting, arithmetic. Repetitive answers (lists, code) are where speculation pays most.
DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "List the days of the week.",
    "Write a Python function that returns the square of a number.",
    "Explain in two sentences why the sky is blue.",
    "Count from one to ten in words.",
    "Give three tips for learning a new language.",
    "Translate 'good morning' into Spanish, French and German.",
    "What is 12 times 12? Answer with the number and one sentence.",
)

DEFAULT_CALIB_TEXT = """\
The river runs through the middle of the old town, under seven stone bridges. In spring the water
is high and brown with melted snow from the mountains; in late summer it is clear enough to see the
fish resting in the shade of the arches. Market stalls line the eastern bank every Saturday, selling
bread, cheese, apples, honey and flowers, and the smell of roasted chestnuts drifts across the square
when the weather turns cold.

A computer program is a list of instructions that a machine follows one after another. Variables
hold values, functions group instructions under a name, and loops repeat work until a condition is
met. Good programs are written for people first: clear names, short functions and comments that
explain why a choice was made are worth more than clever tricks that save a line.

def mean(values):
    total = 0.0
    for v in values:
        total += v
    return total / len(values) if values else 0.0

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

Photosynthesis is the process by which plants, algae and some bacteria turn light into chemical
energy. Chlorophyll absorbs red and blue light and reflects green, which is why leaves look green.
The energy splits water into oxygen and hydrogen; the hydrogen, together with carbon dioxide from
the air, is built into sugars that feed the plant and, through food chains, almost every animal.

User: Can you recommend a book for a long train journey?
Assistant: A long novel works well on a train. If you like adventure, try a classic sea story; if
you prefer something calm, a collection of short stories lets you stop at any station.

A good loaf of bread needs only flour, water, salt and yeast, but it also needs time. The dough is
mixed, left to rise until it has doubled, folded to build strength, shaped and left to rise again.
A hot oven with a tray of water on the bottom shelf gives the crust its colour and crackle, and the
loaf should cool on a rack for an hour before it is cut, or the crumb will be gummy.

The history of the bicycle is a story of small improvements. Early machines had no pedals and were
pushed along with the feet; later ones had a huge front wheel that made them fast but dangerous.
The safety bicycle, with two wheels of equal size and a chain to the rear wheel, made cycling
popular with everyone, and air-filled tyres soon made the ride comfortable on rough roads.

User: How do I keep basil alive on a windowsill?
Assistant: Give it at least six hours of sun, water it when the top of the soil feels dry, and pinch
off the flower buds so that the plant keeps growing leaves instead of going to seed.
User: How do I make a simple tomato sauce?
Assistant: Warm olive oil in a pan, soften a chopped onion and a clove of garlic, add a tin of
tomatoes, a pinch of salt and some basil, and let it simmer for twenty minutes.

The history of measurement is a history of agreement. Early units were based on the human body, a
foot, a hand, a stride, and they changed from town to town. Trade pushed cities to agree on common
standards, and in the eighteenth century the metre was defined from the size of the Earth itself.
Today the units are defined from constants of nature, so that a laboratory anywhere can reproduce
them exactly.

Monday: team meeting at nine, review the budget, call the supplier about the late delivery.
Tuesday: write the quarterly summary, answer customer emails, book the meeting room for Friday.
Wednesday: visit the warehouse, check the inventory counts, update the spreadsheet.
Thursday: interview two candidates, prepare slides for the board, leave early for the dentist.
Friday: present the results, plan the next quarter, and send the weekly newsletter.

Mathematics gives names to patterns. The sum of the first n odd numbers is n squared: one, one plus
three is four, plus five is nine, plus seven is sixteen. A prime number has exactly two divisors,
one and itself; there are infinitely many of them, as Euclid proved more than two thousand years ago
by multiplying a finite list of primes together and adding one.
"""

DEFAULT_EVAL_TEXT = """\
The lighthouse stood on a rock at the end of a narrow causeway, and at high tide it became an island.
The keeper climbed its one hundred and twelve steps four times a day to wind the clockwork that
turned the lamp, to clean the great glass lens, and to write the weather in a leather logbook. Ships
passing in the night saw the beam sweep across the water every ten seconds and knew where they were.

Baking bread needs only flour, water, salt and yeast, but the order and the timing matter. Mix the
flour and water first and let them rest, so the flour absorbs the water and the gluten begins to
form. Add the salt and the yeast, knead until the dough is smooth and elastic, and leave it covered
in a warm place until it has doubled in size. Shape the loaf, let it rise again, and bake it in a
very hot oven with a tray of water underneath, which keeps the crust soft long enough for the bread
to expand.

A hash table stores pairs of keys and values. A hash function turns each key into an index in an
array; looking a key up means computing its hash and reading one slot, which takes constant time on
average. When two keys land in the same slot, the table must resolve the collision, either by
keeping a short list in each slot or by probing the next free slot. As the table fills up,
collisions become more frequent, so the array is grown and every key is inserted again.

def binary_search(items, target):
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1

The Moon always shows the same face to the Earth because it turns once on its axis in the time it
takes to go once around the planet. Over millions of years the pull of the Earth slowed its rotation
until the two periods matched. The same tides that locked the Moon are slowly lengthening our own
day, by a couple of thousandths of a second every century, and pushing the Moon a few centimetres
further away each year.

Question: How many minutes are there in a day? Answer: There are sixty minutes in an hour and
twenty-four hours in a day, so a day has one thousand four hundred and forty minutes.
Question: Which is heavier, a kilogram of feathers or a kilogram of iron? Answer: Neither; both
weigh one kilogram, although the feathers take up far more space.
"""
