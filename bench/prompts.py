"""Prompt sets for the speculation benchmarks, as chat conversations for the default model.

Four kinds, from most to least copyable material:

- `rewrite`: fix, rephrase or summarize a given paragraph; the answer repeats much of the input.
- `code`: edit a given Python function; the answer repeats the function with small changes.
- `docqa`: answer a question from a given document; the answer quotes the document.
- `chat`: open questions with nothing in the prompt to copy from.

Every kind has at least eight prompts (batch 8 runs eight different prompts of one kind). The texts are
written for this benchmark; instructions are short and plain because the default model is small (135M).
"""

from __future__ import annotations

from typing import NamedTuple

KINDS = ("rewrite", "code", "docqa", "chat")


class Prompt(NamedTuple):
    kind: str
    name: str  # short label, unique within its kind
    messages: tuple[dict[str, str], ...]  # one user turn, the model's chat template applies


def _user(text: str) -> tuple[dict[str, str], ...]:
    return ({"role": "user", "content": text.strip()},)


# ---------------------------------------------------------------------------------------------- rewrite
_REWRITE = [
    ("grammar", """Fix the grammar mistakes in the following paragraph and keep everything else the same:

Last summer me and my brother goes to the lake every morning. The water were cold but we swims anyway
because the sun was already hot. Our grandmother have a small boat that she let us use if we was careful.
One day the boat get stuck in the reeds and we has to push it back to the shore with our hands. When we
come home, grandmother laugh and say that every sailor need one story like that. We still talks about
that day when the family meet for dinner."""),
    ("summarize", """Summarize the following text in two sentences:

The town library opened a repair cafe on the first Saturday of every month. Volunteers with tools sit at
long tables and help visitors fix broken lamps, toasters, bicycles and clothes. Nobody pays for the
repairs, but visitors are asked to stay and watch, so that they learn how to do it themselves next time.
In the first year the cafe fixed more than four hundred items, and the volunteers say that most of the
problems were simple: a loose wire, a worn belt, a missing screw. The library now plans to lend tools as
well as books, starting with drills, sewing machines and a soldering iron."""),
    ("passive", """Rewrite the following paragraph in the passive voice:

The committee approved the new budget on Monday. The mayor signed the plan the next morning. Workers will
repair the old bridge in the spring, and a local company will paint the school in the summer. The city
also bought three electric buses, and drivers will test them on the river route. Residents sent many
letters about the park, so the council added new benches and planted forty trees near the playground."""),
    ("spelling", """Correct the spelling mistakes in this paragraph:

Every mornning the baker opens her shop at six oclock. She makes fresh bred, sweet rolls and a famous
apple cake that peple come from far away to buy. The shop is small, but it is allways warm and smells of
cinamon. On Fridays she bakes speshal loaves with seeds and honey. Children like to watch her through the
window while she kneeds the dough, and sometimes she gives them a small peice of cake to try."""),
    ("present_tense", """Rewrite the following paragraph in the present tense:

The train left the station at noon. Maria sat by the window and watched the fields go by. She opened her
notebook and wrote a letter to her sister. The conductor checked the tickets and told the passengers that
the next stop was in twenty minutes. Outside, the sky turned grey and it started to rain. Maria closed
her notebook, leaned back in her seat and listened to the rain on the glass."""),
    ("past_tense", """Rewrite the following paragraph in the past tense:

Every spring the village holds a market in the main square. Farmers bring eggs, cheese, honey and young
plants, and a baker sells warm bread from a cart. Children paint their faces and run between the stalls.
At noon a band plays old songs on the steps of the town hall, and people dance in the sun. In the evening
the farmers pack their trucks, the square becomes quiet again, and the cleaners sweep away the flowers."""),
    ("replace_word", """Rewrite the following paragraph, replacing the word "dog" with "cat" everywhere:

Our neighbor has a dog named Pepper. Every evening the dog waits by the gate for the children to come
home from school. When the dog sees them, it runs in circles and barks with joy. The dog sleeps on an old
blanket in the kitchen and eats twice a day. On weekends the family takes the dog to the park, where the
dog chases leaves and plays with other animals until it is tired."""),
    ("simplify", """Rewrite the following paragraph using simpler words, keeping the same sentences:

The expedition commenced its ascent at dawn, as the meteorological forecast indicated favorable
conditions. The participants carried substantial provisions, including additional garments and
sufficient water for three days. Midway through the ascent, one member experienced considerable fatigue,
so the group decided to establish a temporary encampment beside a tranquil lake. The following morning,
having recuperated, they resumed the journey and attained the summit shortly after midday."""),
    ("bullets", """Rewrite this paragraph as a bulleted list of steps:

To plant a tomato seedling, first choose a sunny spot in the garden. Dig a hole that is deeper than the
pot. Remove the seedling from the pot and gently loosen the roots. Place the seedling in the hole so that
part of the stem is under the soil. Fill the hole with soil and press it down lightly. Water the plant
well, and then push a wooden stick into the ground next to it for support."""),
]

# ------------------------------------------------------------------------------------------------- code
_CODE = [
    ("type_hints", '''def average_scores(scores, min_count):
    total = 0
    count = 0
    for name in scores:
        value = scores[name]
        if value is None:
            continue
        total = total + value
        count = count + 1
    if count < min_count:
        return None
    return total / count

Add type hints to the Python function above.'''),
    ("rename", '''Rename the variable x to count in this code:

def count_words(text):
    x = 0
    for line in text.splitlines():
        words = line.split()
        x = x + len(words)
    if x == 0:
        print("empty text")
    return x'''),
    ("docstring", '''Add a docstring to this Python function:

def merge_sorted(left, right):
    result = []
    i = 0
    j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result'''),
    ("comments", '''Add a comment at the top of this function that explains what it does:

def read_config(path):
    settings = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings'''),
    ("fix_bug", '''This function should return the largest number in the list, but it has a bug. Fix it:

def find_max(numbers):
    if not numbers:
        return None
    best = numbers[0]
    for number in numbers:
        if number < best:
            best = number
    return best'''),
    ("snake_case", '''Rename the functions and variables in this code to snake_case:

def computeTotalPrice(itemPrices, taxRate):
    subTotal = 0
    for itemPrice in itemPrices:
        subTotal += itemPrice
    taxAmount = subTotal * taxRate
    totalPrice = subTotal + taxAmount
    return totalPrice

def printReceipt(itemPrices, taxRate):
    totalPrice = computeTotalPrice(itemPrices, taxRate)
    print("Total:", totalPrice)'''),
    ("rename_function", '''Rewrite this code with the function parse_row renamed to split_fields:

def parse_row(line):
    fields = line.split(",")
    cleaned = []
    for field in fields:
        field = field.strip()
        if field == "":
            cleaned.append(None)
        else:
            cleaned.append(field)
    return cleaned'''),
    ("class_method", '''Add a method `reset` that sets the count back to zero to this class:

class Counter:
    def __init__(self, start=0):
        self.count = start
        self.history = []

    def increment(self, step=1):
        self.count += step
        self.history.append(step)

    def value(self):
        return self.count'''),
    ("error_handling", '''Add error handling to this function so it returns None if the file does not exist:

def load_numbers(path):
    numbers = []
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if line:
                numbers.append(float(line))
    return numbers'''),
]

# ------------------------------------------------------------------------------------------------ docqa
_DOCQA = [
    ("museum_hours", """Read the document and answer the question using the words of the document.

Document: The Riverside Museum of Science is open from Tuesday to Sunday, from 10 am to 6 pm. On
Thursdays it stays open until 9 pm. The museum is closed on Mondays and on public holidays. Tickets cost
12 dollars for adults and 6 dollars for children under 14. Children under 4 enter for free. Students
with a valid card pay 8 dollars. The planetarium show starts every hour and is included in the ticket.

Question: When is the museum open, and how much does a ticket cost for an adult?"""),
    ("warranty", """Read the document and answer the question using the words of the document.

Document: Every Nordlight lamp comes with a two-year warranty from the date of purchase. The warranty
covers defects in materials and workmanship. It does not cover damage caused by dropping the lamp, by
using the wrong bulb, or by water. To make a claim, send an email to support with a photo of the lamp and
a copy of the receipt. We will send a replacement part or a new lamp within ten working days.

Question: What does the warranty not cover?"""),
    ("recipe", """Read the document and answer the question using the words of the document.

Document: To make the lentil soup, wash one cup of red lentils and put them in a large pot. Add one
chopped onion, two carrots cut into small pieces and one clove of garlic. Pour in four cups of water and
bring the soup to a boil. Then lower the heat and let it cook for twenty-five minutes, until the lentils
are soft. Add salt, pepper and a spoon of lemon juice before serving.

Question: How long should the soup cook, and what do you add before serving?"""),
    ("policy", """Read the document and answer the question using the words of the document.

Document: Employees may work from home up to two days per week. Home working days must be agreed with
the team leader at least one week in advance. During home working days, employees must be reachable by
phone and email between 9 am and 4 pm. The company provides a laptop and a headset, but not a desk or a
chair. Expenses for internet access are not refunded.

Question: How many days per week may employees work from home, and when must they be reachable?"""),
    ("history", """Read the document and answer the question using the words of the document.

Document: The old stone bridge in Millford was built in 1712 by a group of local farmers who needed a
way to bring their grain to the market across the river. It has five arches and is made of grey granite
taken from the hills north of the town. In 1890 the bridge was made wider so that carts could pass each
other. Since 1975 only people on foot and bicycles may cross it.

Question: Who built the bridge, and why did they build it?"""),
    ("train_rules", """Read the document and answer the question using the words of the document.

Document: Passengers may bring one large bag and one small bag on the train. Bicycles are allowed only
in the first carriage and must be booked in advance. Dogs may travel for free if they are on a lead.
Eating is allowed, but hot food may not be eaten in the quiet carriage. Tickets must be shown to the
conductor on request, and a ticket bought on the train costs five dollars more.

Question: Where are bicycles allowed on the train?"""),
    ("plant_care", """Read the document and answer the question using the words of the document.

Document: The snake plant needs very little care. Water it only when the soil is completely dry, which
is usually every two to three weeks. Too much water will make the roots rot. The plant grows best in
bright, indirect light, but it can also live in a dark corner. Keep it away from cold windows in winter.
Repot it every two years in the spring, using a pot that is only slightly larger.

Question: How often should you water the snake plant?"""),
    ("meeting_notes", """Read the document and answer the question using the words of the document.

Document: Meeting notes, 14 March. Present: Lena, Omar, Priya and Jack. The team agreed to move the
product launch from April to the first week of May, because the testing phase needs two more weeks.
Omar will update the website text by 20 March. Priya will contact the three pilot customers and ask for
feedback. Jack will prepare the budget for the launch event. The next meeting is on 21 March at 10 am.

Question: Why was the product launch moved, and to when?"""),
    ("battery", """Read the document and answer the question using the words of the document.

Document: The Trailmate speaker has a battery that lasts up to 18 hours at medium volume. A full charge
takes about three hours with the included USB-C cable. When the battery is low, the light on top of the
speaker turns red and blinks slowly. The speaker is waterproof for up to thirty minutes at a depth of
one meter, but the charging port must be closed before it gets wet.

Question: How long does the battery last, and how long does a full charge take?"""),
]

# ------------------------------------------------------------------------------------------------- chat
_CHAT = [
    ("hobby", "What is a good hobby to start if I have one free hour every evening?"),
    ("sleep", "Give me some tips for sleeping better."),
    ("seasons", "Why do we have seasons on Earth?"),
    ("story", "Tell me a short story about a lighthouse keeper."),
    ("learn_language", "How can I learn a new language faster?"),
    ("breakfast", "What is a healthy breakfast I can make in five minutes?"),
    ("rainbow", "Explain how a rainbow forms."),
    ("interview", "How should I prepare for a job interview?"),
    ("city_or_country", "Is it better to live in a city or in the countryside?"),
]

# ---------------------------------------------------------------------------------------------- extract
# JSON extraction from a given text under a JSON schema (structured output). Not one of KINDS: its prompts need
# their schema (EXTRACT_SCHEMAS) to mean anything, and only bench/spec.py passes it (`--kinds extract`).
EXTRACT_KIND = "extract"
_PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}, "job": {"type": "string"}},
    "required": ["name", "age", "city", "job"], "additionalProperties": False}
_ORDER = {"type": "object", "properties": {
    "order_id": {"type": "string"}, "items": {"type": "array", "items": {"type": "object", "properties": {
        "product": {"type": "string"}, "quantity": {"type": "integer"}}, "required": ["product", "quantity"],
        "additionalProperties": False}}, "total_eur": {"type": "number"}},
    "required": ["order_id", "items", "total_eur"], "additionalProperties": False}
_EVENT = {"type": "object", "properties": {
    "title": {"type": "string"}, "date": {"type": "string"}, "place": {"type": "string"},
    "speakers": {"type": "array", "items": {"type": "string"}}},
    "required": ["title", "date", "place", "speakers"], "additionalProperties": False}
_EXTRACT = [
    ("person_baker", "Extract the person as JSON (name, age, city, job).\n\nText: Maria Lopez is a 34-year-old "
     "baker who lives in Valencia. She opens her shop at six every morning."),
    ("order_shop", "Extract the order as JSON (order_id, items with product and quantity, total_eur).\n\nText: "
     "Order A-1187 contains two blue mugs, one teapot and four packs of green tea. The total is 46.50 euros."),
    ("event_meetup", "Extract the event as JSON (title, date, place, speakers).\n\nText: The Python Meetup "
     "Spring Session takes place on 12 April 2025 at the City Library in Ghent. Talks are given by Anna Peeters "
     "and Tom Janssens."),
    ("person_pilot", "Extract the person as JSON (name, age, city, job).\n\nText: Our new colleague, Kenji "
     "Sato, is 41. He flew cargo planes for ten years and now lives in Osaka, where he works as a pilot "
     "instructor."),
    ("order_bikes", "Extract the order as JSON (order_id, items with product and quantity, total_eur).\n\n"
     "Text: For order B-2090 the customer bought one city bike, two helmets and a lock, paying 689.00 euros."),
    ("event_concert", "Extract the event as JSON (title, date, place, speakers).\n\nText: The Winter Strings "
     "concert is on 3 December 2024 in the Old Church of Leiden, with short introductions by Eva de Boer."),
]
EXTRACT_SCHEMAS = {name: schema for (name, _), schema in zip(
    _EXTRACT, [_PERSON, _ORDER, _EVENT, _PERSON, _ORDER, _EVENT])}

_BY_KIND = {"rewrite": _REWRITE, "code": _CODE, "docqa": _DOCQA, "chat": _CHAT, EXTRACT_KIND: _EXTRACT}


def prompts_of(kind: str) -> list[Prompt]:
    """Every prompt of one kind, in a fixed order (benchmarks take prefixes of this list)."""
    if kind not in _BY_KIND:
        raise ValueError(f"kind: must be one of {', '.join(KINDS)}, got {kind!r}")
    return [Prompt(kind, name, _user(text)) for name, text in _BY_KIND[kind]]


def all_prompts() -> list[Prompt]:
    return [p for kind in KINDS for p in prompts_of(kind)]
