"""A seeded generator of simple TinyStories-like English stories with negation structure.

Every story has one or more episodes. An episode opens with an event of positive or
negative valence ("her kite flew over the hills" / "her kite broke"), and the
characters' reactions follow: plain ones agree with the valence ("she was happy"), negated
ones take a sentiment word of the opposite valence ("she was not sad"). So the word after a
negation can be predicted only from the negation AND the context's valence, the structure
a bilinear MLP can compute as a product of two features.

Each story comes with character-level ground truth: where each negation's scope (from the
cue up to the word it flips: "not", "did not feel") and each sentiment word is, and which
valence the context has from each point on. `pipelines.data.story_corpus.story_spans` turns it
into labelled spans, the corpus format that any corpus can use.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from circuits.config import Config, option, seed_option

NAMES = {
    "she": ["Mia", "Lily", "Emma", "Sara", "Anna", "Zoe", "Lucy", "Ella", "Amy", "Rose",
            "Kate", "Nora", "Ruby", "Ivy", "Maya", "Lena", "Jane", "Sue", "Tina", "Beth"],
    "he": ["Tom", "Ben", "Max", "Sam", "Leo", "Jack", "Tim", "Finn", "Noah", "Jake",
           "Dan", "Luke", "Owen", "Eli", "Paul", "Ned", "Bob", "Joe", "Ryan", "Alex"],
}
POSSESSIVE = {"she": "her", "he": "his"}
OBJECT_PRONOUN = {"she": "her", "he": "him"}
TOYS = ["ball", "kite", "doll", "car", "boat", "teddy bear", "drum", "book", "hat", "bike",
        "train", "puzzle", "robot", "blanket", "cup", "box", "shell", "crayon", "balloon",
        "wagon"]
COLOURS = ["red", "blue", "green", "yellow", "little", "big", "shiny", "soft", "old", "new"]
PLACES = ["park", "garden", "beach", "forest", "school", "farm", "lake", "yard", "zoo",
          "store", "library", "hill", "kitchen", "river", "playground"]
FRIENDS = ["mom", "dad", "sister", "brother", "friend", "grandma", "grandpa", "teacher",
           "dog", "cat", "neighbor", "aunt", "uncle", "puppy", "bunny"]
POSITIVE = ["happy", "glad", "excited", "proud", "joyful", "cheerful", "calm", "thankful",
            "delighted", "pleased"]
NEGATIVE = ["sad", "upset", "angry", "scared", "lonely", "grumpy", "worried", "afraid",
            "unhappy", "mad"]

# Events that set the valence of what follows; slots are filled per story.
GOOD_EVENTS = [
    "{pos} {friend} gave {obj} a {colour} {toy}",
    "{subj} found a {colour} {toy} at the {place}",
    "{pos} {friend} came to play at the {place}",
    "{subj} won a prize at the {place}",
    "the sun came out and {subj} went to the {place}",
    "{pos} {friend} baked a big cake for {obj}",
    "{subj} learned to ride {pos} {colour} bike",
    "{pos} lost {toy} was found at the {place}",
    "{subj} made a new friend at the {place}",
    "{pos} {friend} took {obj} to the {place} for a treat",
]
BAD_EVENTS = [
    "{pos} {colour} {toy} broke",
    "{subj} lost {pos} {toy} at the {place}",
    "{pos} {friend} got sick and could not play",
    "a big storm came and {subj} had to stay inside",
    "{subj} fell down at the {place} and hurt {pos} knee",
    "a mean boy took {pos} {toy} at the {place}",
    "{pos} {toy} fell into the {place} and was gone",
    "{pos} {friend} had to go far away",
    "{subj} dropped {pos} ice cream at the {place}",
    "the {place} was closed and {subj} could not go in",
]
# Reactions: "{sent}" is a sentiment word, "{neg}" a negation cue that flips it.
PLAIN_REACTIONS = [
    "{Name} was {sent}.",
    "{Subj} was so {sent}.",
    "{Subj} felt {sent}.",
    "{Name} felt very {sent}.",
    "{Pos} {friend} was {sent} too.",
    "\"I am {sent},\" said {Name}.",
    "{Name} looked {sent}.",
]
NEGATED_REACTIONS = [
    "{Name} was {neg:not} {sent}.",
    "{Subj} was {neg:not} {sent} at all.",
    "{Subj} {neg:wasn't} {sent}.",
    "{Name} {neg:did not} feel {sent}.",
    "{Subj} {neg:didn't} feel {sent}.",
    "{Pos} {friend} was {neg:not} {sent} either.",
    "\"I am {neg:not} {sent},\" said {Name}.",
    "{Name} was {neg:never} {sent} that day.",
    "{Subj} {neg:wasn't} {sent} anymore.",
]
OPENINGS = [
    "Once upon a time, there was a {colour} {kind} named {Name}.",
    "{Name} was a {colour} {kind} who lived near the {place}.",
    "One day, a {kind} named {Name} went to the {place}.",
    "There was a {kind} called {Name}. {Subj} loved {pos} {toy}.",
]
KINDS = {"she": ["girl", "bunny", "duck", "kitten"], "he": ["boy", "bear", "frog", "puppy"]}
TURNS = ["One day,", "Then", "Later,", "But then", "The next day,", "After lunch,", "Soon,"]
ENDINGS = [
    "The end.",
    "{Name} went home and had a nap.",
    "That night, {Name} went to bed.",
    "{Subj} hugged {pos} {friend}.",
]


@dataclass(frozen=True)
class StoryConfig(Config):
    """How many stories to make and how they are mixed."""

    n_stories: int = option(20000, "stories to generate", low=1)
    seed: int = seed_option("seed of the generator; same seed, same corpus")
    min_episodes: int = option(1, "fewest valence episodes per story", low=1)
    max_episodes: int = option(3, "most valence episodes per story", low=1)
    min_reactions: int = option(1, "fewest reaction sentences per episode", low=1)
    max_reactions: int = option(3, "most reaction sentences per episode", low=1)
    negation_rate: float = option(0.5, "share of reactions that are negated", low=0.0, high=1.0)

    def check(self) -> None:
        if self.min_episodes > self.max_episodes or self.min_reactions > self.max_reactions:
            raise ValueError("StoryConfig: min_episodes/min_reactions must not exceed max_episodes/max_reactions")


@dataclass
class Story:
    """One story with its ground truth, as character spans into `text`."""

    text: str
    negation_spans: list[tuple[int, int]] = field(default_factory=list)  # cue up to the flipped word
    sentiment_spans: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, ±1)
    context_spans: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, ±1)


class _Writer:
    """Appends sentences to a story while recording ground-truth spans."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.length = 0
        self.story = Story(text="")

    def add(self, template: str, slots: dict, sentiment: int = 0) -> None:
        """Add one sentence; `{neg:cue}` marks a negation cue, `{sent}` the sentiment word."""
        if self.parts:
            self._emit(" ")
        pieces = template.split("{")
        self._emit(pieces[0])
        negation_start = None
        for piece in pieces[1:]:
            key, rest = piece.split("}", 1)
            if key.startswith("neg:"):
                negation_start = self.length
                self._emit(key[4:])
            elif key == "sent":
                start = self.length
                if negation_start is not None:
                    # the scope runs from the cue to the word it flips ("did not feel")
                    self.story.negation_spans.append((negation_start, start - 1))
                self._emit(slots["sent"])
                self.story.sentiment_spans.append((start, self.length, sentiment))
            else:
                self._emit(slots[key])
            self._emit(rest)

    def _emit(self, s: str) -> None:
        self.parts.append(s)
        self.length += len(s)

    def finish(self) -> Story:
        self.story.text = "".join(self.parts)
        return self.story


def _capitalise(s: str) -> str:
    return s[:1].upper() + s[1:]


def make_story(rng: random.Random, cfg: StoryConfig) -> Story:
    """One random story; all randomness comes from `rng`."""
    gender = rng.choice(["she", "he"])
    slots = {
        "Name": rng.choice(NAMES[gender]),
        "subj": gender,
        "Subj": _capitalise(gender),
        "pos": POSSESSIVE[gender],
        "Pos": _capitalise(POSSESSIVE[gender]),
        "obj": OBJECT_PRONOUN[gender],
        "kind": rng.choice(KINDS[gender]),
        "toy": rng.choice(TOYS),
        "colour": rng.choice(COLOURS),
        "place": rng.choice(PLACES),
        "friend": rng.choice(FRIENDS),
    }
    w = _Writer()
    w.add(rng.choice(OPENINGS), slots)
    n_episodes = rng.randint(cfg.min_episodes, cfg.max_episodes)
    valence = rng.choice([1, -1])
    for episode in range(n_episodes):
        if episode:
            # Later episodes mostly turn the mood, so valence must be read from recent context.
            valence = -valence if rng.random() < 0.75 else valence
        slots.update(toy=rng.choice(TOYS), place=rng.choice(PLACES),
                     friend=rng.choice(FRIENDS), colour=rng.choice(COLOURS))
        event = rng.choice(GOOD_EVENTS if valence > 0 else BAD_EVENTS)
        turn = rng.choice(TURNS)
        start = w.length + (1 if w.parts else 0)
        w.add(f"{turn} {event}.", slots)
        for _ in range(rng.randint(cfg.min_reactions, cfg.max_reactions)):
            negated = rng.random() < cfg.negation_rate
            word_valence = -valence if negated else valence
            slots["sent"] = rng.choice(POSITIVE if word_valence > 0 else NEGATIVE)
            template = rng.choice(NEGATED_REACTIONS if negated else PLAIN_REACTIONS)
            w.add(template, slots, sentiment=word_valence)
        w.story.context_spans.append((start, w.length, valence))
    w.add(rng.choice(ENDINGS), slots)
    story = w.finish()
    story.text = _capitalise(story.text)
    return story


def generate_stories(cfg: StoryConfig) -> list[Story]:
    """`cfg.n_stories` stories, the same for the same seed."""
    rng = random.Random(cfg.seed)
    return [make_story(rng, cfg) for _ in range(cfg.n_stories)]
