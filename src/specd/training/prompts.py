"""The prompt set `specd train-draft` uses by default: instructions across chat, writing, code, QA, summarising and
editing, generated from templates and subjects written for this project (no downloads).

Every template is crossed with a fixed, seeded choice of subjects, so the set is the same on every machine. None of
it is benchmark text: tests/training/test_prompts.py checks that no prompt shares an 8-word run with
bench/prompts.py's suites, so acceptance measured on the benchmarks is never measured on training text.
"""

from __future__ import annotations

import random
from typing import NamedTuple


class TrainingPrompt(NamedTuple):
    kind: str  # chat, writing, code, qa, summarise, edit
    text: str  # one user turn
    template: str | None = None  # e.g. "chat/3": the template it was made from; None for a question of its own


_TOPICS = [
    "volcanoes", "honey bees", "the moon's phases", "compound interest", "photosynthesis", "black holes",
    "the water cycle", "vaccines", "electric cars", "coral reefs", "the printing press", "glaciers",
    "solar panels", "the stock market", "earthquakes", "migrating birds", "recycling plastic", "tides",
    "the human heart", "coffee", "bread baking", "chess openings", "the Roman Empire", "jazz music",
    "cloud computing", "magnets", "rain forests", "the immune system", "wind turbines", "octopuses",
    "the internet", "climate change", "dinosaurs", "the Olympic games", "gravity", "mushrooms",
    "public libraries", "trains", "deserts", "bicycles", "penguins", "the periodic table", "sleep cycles",
    "museums", "bridges", "paper money", "maps", "telescopes", "tea ceremonies", "pyramids",
]

_ACTIVITIES = [
    "saving money on groceries", "running a first 5k race", "keeping houseplants alive", "studying for exams",
    "writing a cover letter", "cooking rice", "planning a road trip", "making new friends in a new city",
    "learning to draw", "staying focused while working from home", "training a puppy", "starting a vegetable garden",
    "giving a short speech", "reading more books", "organising a small kitchen", "taking better photos with a phone",
    "learning to swim as an adult", "packing for a long flight", "reducing screen time", "hosting a dinner party",
    "choosing a laptop", "keeping a journal", "practising the guitar", "cleaning a bathroom quickly",
    "drinking more water", "preparing for a hiking trip", "negotiating a salary", "making a monthly budget",
]

_CHAT_TEMPLATES = [
    "Explain {topic} to a ten-year-old.",
    "What are three surprising facts about {topic}?",
    "Why is {topic} important?",
    "Can you describe how {topic} work or worked, in simple words?",
    "What would a beginner want to know about {topic}?",
    "I have a test tomorrow about {topic}. What are the key points?",
    "Give me some advice about {activity}.",
    "What are common mistakes people make when {activity}?",
    "I want to get better at {activity}. Where should I start?",
    "Make a short step-by-step plan for {activity}.",
    "My friend says {activity} is too hard. How would you encourage them?",
]

_WRITING_TEMPLATES = [
    "Write a short poem about {topic}.",
    "Write a short story in which a child discovers something about {topic}.",
    "Write a friendly email inviting my neighbours to a talk about {topic}.",
    "Write a product description for a board game about {topic}.",
    "Write a diary entry of someone who spent a whole day {activity}.",
    "Write a motivational message for a friend who is {activity}.",
    "Write a four-line rhyme for children about {topic}.",
    "Write a tweet announcing a workshop on {activity}.",
]

_CODE_TASKS = [
    "reverses the words in a sentence", "checks whether a number is prime", "counts the vowels in a string",
    "returns the n-th Fibonacci number", "removes duplicates from a list while keeping the order",
    "converts Celsius to Fahrenheit", "finds the second largest number in a list", "checks if a string is a palindrome",
    "flattens a nested list", "computes the average of a list of numbers", "merges two dictionaries",
    "returns the most common word in a text", "sorts a list of tuples by their second element",
    "checks whether two words are anagrams", "converts a binary string to an integer",
    "splits a list into chunks of size n", "counts how often each character appears in a string",
    "capitalises the first letter of every word", "returns all even numbers from a list",
    "computes the factorial of a number", "finds the longest word in a sentence", "transposes a matrix",
    "validates a simple email address", "rounds prices to two decimals and sums them",
]

_CODE_TEMPLATES = [
    "Write a Python function that {task}.",
    "Show me a short Python example that {task}, with a comment on each line.",
    "How would you write a JavaScript function that {task}?",
    "Write a Python function that {task}, and add two example calls.",
]

_QA = [
    "How many legs does a spider have?", "What is the boiling point of water at sea level?",
    "Who wrote the play Romeo and Juliet?", "What is the largest planet in the solar system?",
    "How many continents are there, and what are they?", "What gas do plants take in from the air?",
    "What is the difference between weather and climate?", "Why is the sky dark at night?",
    "What is the capital of Japan?", "How does a thermometer work?", "What is a prime number?",
    "Why do cats purr?", "What language is spoken in Brazil?", "How far away is the Sun from the Earth?",
    "What is the tallest mountain in the world?", "How do airplanes stay in the air?",
    "What is the difference between a virus and a bacterium?", "What does DNA stand for?",
    "Why does ice float on water?", "How many bones are in the adult human body?",
    "What causes thunder?", "What is an atom made of?", "Who painted the Mona Lisa?",
    "What is the speed of light?", "Why do leaves change colour in autumn?", "What is inflation?",
    "How do bees make honey?", "What is the longest river in Africa?", "What is a noun?",
    "How does a compass find north?", "What is the freezing point of water in Fahrenheit?",
    "What is the main job of the lungs?", "How many minutes are in a day?", "What is an island?",
    "Why do we need sleep?", "What is the difference between a lake and a sea?",
]

_NAMES = ["Maya", "Tom", "Aisha", "Lars", "Keiko", "Pedro", "Nina", "Omar", "Grace", "Ivan", "Zara", "Felix"]
_PLACES = ["a harbour town", "a mountain village", "a busy school", "a small bakery", "a city park",
           "a train station", "a farm", "a science museum", "an old theatre", "a community garden"]
_EVENTS = ["a summer festival", "a power cut", "a surprise visit", "a charity run", "a storm",
           "a book fair", "a cooking contest", "a lost dog", "a new bus line", "a school play"]
_OUTCOMES = ["everyone agreed to do it again next year", "the money raised paid for new chairs",
             "the local paper wrote about it", "people stayed until late in the evening",
             "a few volunteers promised to help next time", "the mayor thanked the organisers"]


def _paragraph(rng: random.Random) -> str:
    name, other = rng.sample(_NAMES, 2)
    place, event, outcome = rng.choice(_PLACES), rng.choice(_EVENTS), rng.choice(_OUTCOMES)
    day = rng.choice(["On Monday", "Last weekend", "In early spring", "One rainy Thursday", "At the end of May"])
    count = rng.randint(12, 300)
    return (f"{day}, {place} held {event}. {name} organised most of it with help from {other}, who had "
            f"done something similar before. About {count} people came, more than expected, so the two of them "
            f"had to find extra tables and borrow chairs from a neighbour. There were a few problems at the start, "
            f"but by the afternoon things ran smoothly. In the end {outcome}.")


_SUMMARISE_TEMPLATES = [
    "Summarise this text in one sentence:\n\n{paragraph}",
    "Give a title and a two-sentence summary of this story:\n\n{paragraph}",
    "What is the main point of this paragraph?\n\n{paragraph}",
    "List the people and places mentioned in this text:\n\n{paragraph}",
]

_EDIT_TEMPLATES = [
    "Make this paragraph more formal:\n\n{paragraph}",
    "Rewrite this paragraph for a children's magazine:\n\n{paragraph}",
    "Turn this paragraph into three bullet points:\n\n{paragraph}",
    "Translate the following paragraph into simple English for a language learner:\n\n{paragraph}",
]


def training_prompts(seed: int = 0) -> list[TrainingPrompt]:
    """The default training prompt set (446 instructions), in a fixed, shuffled order. Each names the template it
    was made from (the QA questions stand alone), so whole templates can be held out of training."""
    rng = random.Random(seed)
    prompts: list[TrainingPrompt] = []
    for number, template in enumerate(_CHAT_TEMPLATES):
        slot, pool = ("topic", _TOPICS) if "{topic}" in template else ("activity", _ACTIVITIES)
        for subject in rng.sample(pool, 14):
            prompts.append(TrainingPrompt("chat", template.format(**{slot: subject}), f"chat/{number}"))
    for number, template in enumerate(_WRITING_TEMPLATES):
        slot, pool = ("topic", _TOPICS) if "{topic}" in template else ("activity", _ACTIVITIES)
        for subject in rng.sample(pool, 12):
            prompts.append(TrainingPrompt("writing", template.format(**{slot: subject}), f"writing/{number}"))
    for number, template in enumerate(_CODE_TEMPLATES):
        for task in rng.sample(_CODE_TASKS, 16):
            prompts.append(TrainingPrompt("code", template.format(task=task), f"code/{number}"))
    prompts += [TrainingPrompt("qa", question) for question in _QA]
    for number, template in enumerate(_SUMMARISE_TEMPLATES):
        for _ in range(14):
            prompts.append(TrainingPrompt("summarise", template.format(paragraph=_paragraph(rng)),
                                          f"summarise/{number}"))
    for number, template in enumerate(_EDIT_TEMPLATES):
        for _ in range(10):
            prompts.append(TrainingPrompt("edit", template.format(paragraph=_paragraph(rng)), f"edit/{number}"))
    rng.shuffle(prompts)
    return prompts
