"""Seeded multi-document QA: invented people and organisations, 1-hop and 2-hop questions.

A prompt is an instruction (the system part), 8-16 documents (the segments, each about one
entity, 100-400 tokens of the shipped tokenizer) and a question (the suffix); the answer is a
short span ending the line. Every document is built from its entity alone, so the same document
can be reused in any order after any prefix.

1-hop: the question names an entity and one of its attributes; its document holds the answer.
2-hop: the question names a person and asks where their employer is based: the person's
document names the employer, the employer's document names the city. Distractors are other
entities of the same kinds with the same attribute fields.

Splits are by entity name (a stable hash), so no test document, target or distractor, ever
appears in training: `split` is one of "train", "val", "test".
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass

SPLITS = ("train", "val", "test")
_MIN_DOC_CHARS, _MAX_DOC_CHARS = 500, 640
# hash bucket (of 20) -> split: 90 % train, 5 % validation, 5 % test
_SPLIT_OF_BUCKET = {18: "val", 19: "test"}

_SYLLABLES = (
    "ka lo mir ten vos ra bel dun sha tor quin ael zor fen mar lis gor vel nim dra "
    "ost pel rin sul tam yor bri cas hal jun"
).split()
_ORG_KINDS = ("Works", "Guild", "Company", "Foundry", "Trading House", "Mills", "Press", "Labs")
CITIES = (
    "Tarnholm Lowmere Brisk Edda Ostrava Pellin Quarry Ridgeford Saltmarsh Vennick Wexley Yarrow "
    "Corvale Dunmore Fallowby Glenharrow Hollin Irnsby Kestrel Larkspur Marrow Norwick Oakhurst "
    "Pinecrest Rookham Stonebridge Thistle Umber Valewood Windham Ashgrove Briarton"
).split()
OCCUPATIONS = (
    "baker carpenter chemist drummer engineer farmer gardener historian jeweler lawyer mason "
    "navigator painter pilot potter sailor tailor teacher weaver writer"
).split()
COLORS = "amber blue crimson green grey indigo orange purple silver teal violet white yellow".split()
INSTRUMENTS = "cello drum flute guitar harp horn lute oboe piano violin".split()
GOODS = "barrels bells boots candles clocks glass lamps maps paper rope saddles soap tiles".split()

_FILLER = (
    "{s} often walks along the river in the early morning.",
    "Neighbours describe {s} as quiet but friendly.",
    "On weekends {s} likes to read old travel books.",
    "{s} keeps a small notebook of recipes from many places.",
    "Every spring {s} plants tomatoes and beans behind the house.",
    "{s} once spent a whole summer repairing a wooden boat.",
    "Friends say that {s} tells long stories about the sea.",
    "{s} prefers tea to coffee and rarely travels in winter.",
    "In the evenings {s} sometimes plays chess at the local club.",
    "{s} has visited the northern mountains three times.",
    "A short article about {s} appeared in a local newspaper.",
    "{s} collects postcards and keeps them in a tin box.",
    "As a child {s} wanted to become a famous explorer.",
    "{s} volunteers at the public library twice a month.",
    "Most mornings {s} buys fresh bread from the market square.",
    "{s} is learning to paint landscapes in watercolour.",
    "During the harvest festival {s} helps to decorate the town hall.",
    "{s} writes letters to an old friend who moved abroad.",
)
_ORG_FILLER = (
    "The {s} employs people from several nearby towns.",
    "Visitors to the {s} are shown an old workshop and a small museum.",
    "The {s} publishes a short report at the end of every year.",
    "Many apprentices began their careers at the {s}.",
    "The {s} moved to a larger building after a fire in its first workshop.",
    "Its staff meet once a month to plan new products for the {s}.",
    "The {s} sponsors a music festival every autumn.",
    "Local schools often visit the {s} to learn about its trade.",
    "The {s} is known for careful work and fair prices.",
    "A small team at the {s} repairs old machines for other firms.",
    "The {s} trains young workers in a two-year programme.",
    "Several families have worked at the {s} for generations.",
    "The {s} buys most of its materials from farms in the valley.",
    "Customers of the {s} come from as far as the coast.",
    "The {s} opens its doors to the public on the first day of summer.",
    "A painting of the founders hangs in the main hall of the {s}.",
)
INSTRUCTIONS = (
    "Answer the question using the documents below.",
    "Read the documents and answer the question with a short phrase.",
    "You are a helpful assistant. Use only the following documents.",
    "The documents below describe people and organisations. Answer briefly.",
    "Use the reference documents to answer the final question.",
    "Below are several documents. One or two of them hold the answer.",
)


@dataclass(frozen=True)
class Person:
    name: str
    city: str
    occupation: str
    color: str
    instrument: str
    year: int
    employer: str


@dataclass(frozen=True)
class Org:
    name: str
    city: str
    year: int
    goods: str


@dataclass(frozen=True)
class QAExample:
    instruction: str
    documents: tuple[str, ...]
    question: str
    answer: str
    hops: int
    gold: tuple[int, ...]  # indices of the documents that hold the answer

    @property
    def system(self) -> str:
        return self.instruction + "\n\n"

    @property
    def suffix(self) -> str:
        return question_suffix(self.question)

    def request(
        self, max_new_tokens: int = 8, system: str | None = None, order: list[int] | None = None
    ) -> dict:
        """An engine request (greedy, stops at the end of the line)."""
        docs = [self.documents[i] for i in order] if order is not None else list(self.documents)
        return {
            "system": self.system if system is None else system,
            "segments": docs,
            "suffix": self.suffix,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "stop": ["\n"]},
        }


def question_suffix(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def answer_text(answer: str) -> str:
    """What the model is trained to write after 'Answer:'."""
    return f" {answer}\n"


def normalize_answer(text: str) -> str:
    return " ".join(text.strip().rstrip(".").split()).lower()


def _first_syllable(word: str) -> str:
    """The syllable a generated word starts with (no syllable is a prefix of another)."""
    w = word.lower()
    return next(x for x in _SYLLABLES if w.startswith(x))


def split_of(name: str) -> str:
    bucket = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % 20
    return _SPLIT_OF_BUCKET.get(bucket, "train")


class QAGenerator:
    """Draws examples of one split from a seeded RNG; the same (split, seed) gives the same stream."""

    def __init__(self, split: str = "train", seed: int = 0, min_docs: int = 8, max_docs: int = 16):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        if not 2 <= min_docs <= max_docs:
            raise ValueError("need 2 <= min_docs <= max_docs")
        self.split = split
        self.min_docs = min_docs
        self.max_docs = max_docs
        # Share of each document's filler kept (1 = the task as evaluated; training curricula lower
        # it). The RNG draws the same numbers whatever the value, so only the filler changes.
        self.filler = 1.0
        # Give every entity of a prompt its own first syllable of the word that names it in facts
        # and questions (a person's surname, an organisation's first word), so one token of the
        # question can find its entity (training experiments; off = the default task).
        self.distinct_initials = False
        # Names of one syllable a word (a person "Nim Quin", an organisation "Nim Works"), each
        # entity of a prompt with its own surname (organisation: first word): keys of one or two
        # tokens, the first stage of a training curriculum. In the binding probe at proxy size
        # (benchmarks/results/binding_probe_cpu_20261201.json) one-token keys were bound after
        # 2,000-3,400 steps (not within 7,000 in one run), two-token keys from the start stayed at
        # guessing for 4,000, and a model bound on one-token keys reached 90 % on two-token keys
        # within 100-200 steps. Off = the evaluated task.
        self.short_names = False
        self.rng = random.Random(f"{split}:{seed}")

    def _word(self, n: int) -> str:
        return "".join(self.rng.choice(_SYLLABLES) for _ in range(n)).capitalize()

    def _name(self, make, taken: set[str], key_word: int = 0) -> str:
        """A fresh name of this split; with distinct_initials, also one whose word `key_word`
        starts with a syllable no other entity of the prompt starts that word with."""
        distinct = self.distinct_initials or self.short_names
        for _ in range(1000):
            name = make()
            initial = "^" + _first_syllable(name.split()[key_word]) if distinct else None
            if name not in taken and initial not in taken and split_of(name) == self.split:
                taken.add(name)
                if initial is not None:
                    taken.add(initial)
                return name
        raise RuntimeError("could not draw a fresh entity name")

    def person(self, taken: set[str], employer: str) -> Person:
        r = self.rng
        if self.short_names:
            name = self._name(lambda: f"{self._word(1)} {self._word(1)}", taken, key_word=1)
        else:
            name = self._name(lambda: f"{self._word(2)} {self._word(r.choice((2, 3)))}", taken, key_word=1)
        return Person(
            name,
            r.choice(CITIES),
            r.choice(OCCUPATIONS),
            r.choice(COLORS),
            r.choice(INSTRUMENTS),
            r.randrange(1900, 2000),
            employer,
        )

    def org(self, taken: set[str]) -> Org:
        r = self.rng
        words = 1 if self.short_names else 2
        name = self._name(lambda: f"{self._word(words)} {r.choice(_ORG_KINDS)}", taken)
        return Org(name, r.choice(CITIES), r.randrange(1800, 2000), r.choice(GOODS))

    def person_doc(self, p: Person) -> str:
        r = self.rng
        short = p.name.split()[-1]
        facts = [
            f"{p.name} lives in {p.city}.",
            f"{short} works as a {p.occupation} for the {p.employer}.",
            f"The favourite colour of {p.name} is {p.color}.",
            f"{p.name} was born in {p.year}.",
            f"{short} plays the {p.instrument}.",
        ]
        r.shuffle(facts)
        return self._doc(p.name, facts, _FILLER, short)

    def org_doc(self, o: Org) -> str:
        facts = [
            f"The {o.name} is based in {o.city}.",
            f"The {o.name} was founded in {o.year}.",
            f"The {o.name} makes {o.goods}.",
        ]
        self.rng.shuffle(facts)
        return self._doc(o.name, facts, _ORG_FILLER, o.name)

    def _doc(self, title: str, facts: list[str], filler: tuple[str, ...], short: str) -> str:
        r = self.rng
        # enough filler for ~100-200 tokens of the shipped tokenizer (about 4.5 characters a token)
        target = r.randint(_MIN_DOC_CHARS, _MAX_DOC_CHARS)
        pool = [s.format(s=short) for s in r.sample(filler, len(filler))]
        lines, size = [], sum(len(f) + 1 for f in facts) + len(title) + 12
        if self.filler < 1.0:
            target = size + max(0.0, self.filler) * (target - size)
        while pool and size < target:
            lines.append(pool.pop())
            size += len(lines[-1]) + 1
        # facts first and last around the filler, so answers sit anywhere in the document
        k = r.randint(0, len(facts))
        body = facts[:k] + lines + facts[k:]
        return f"Document: {title}\n" + " ".join(body) + "\n\n"

    def example(self, hops: int | None = None) -> QAExample:
        return self.prompt(1, hops)[0]

    def prompt(self, n_questions: int = 1, hops: int | None = None) -> list[QAExample]:
        """n questions over one shared set of documents (training packs several per prompt)."""
        r = self.rng
        n_docs = r.randint(self.min_docs, self.max_docs)
        taken: set[str] = set()
        n_orgs = max(1, n_docs // 3)
        orgs = [self.org(taken) for _ in range(n_orgs)]
        people = [self.person(taken, r.choice(orgs).name) for _ in range(n_docs - n_orgs)]
        docs = [("p", p, self.person_doc(p)) for p in people] + [("o", o, self.org_doc(o)) for o in orgs]
        r.shuffle(docs)
        texts = tuple(d for _, _, d in docs)
        index = {e.name: i for i, (_, e, _) in enumerate(docs)}
        instruction = r.choice(INSTRUCTIONS)
        out = []
        for _ in range(n_questions):
            h = hops if hops is not None else r.choice((1, 2))
            q, a, gold = self._question(h, people, orgs, index)
            out.append(QAExample(instruction, texts, q, a, h, gold))
        return out

    def _question(self, hops: int, people: list[Person], orgs: list[Org], index: dict[str, int]):
        r = self.rng
        if hops == 2:
            p = r.choice(people)
            o = next(o for o in orgs if o.name == p.employer)
            q = r.choice(
                (
                    f"In which city is the employer of {p.name} based?",
                    f"Where is the organisation that {p.name} works for based?",
                )
            )
            return q, o.city, (index[p.name], index[o.name])
        if hops != 1:
            raise ValueError(f"hops must be 1 or 2, got {hops}")
        if r.random() < 0.2:
            o = r.choice(orgs)
            q, a = r.choice(
                (
                    (f"Where is the {o.name} based?", o.city),
                    (f"When was the {o.name} founded?", str(o.year)),
                    (f"What does the {o.name} make?", o.goods),
                )
            )
            return q, a, (index[o.name],)
        p = r.choice(people)
        q, a = r.choice(
            (
                (f"Where does {p.name} live?", p.city),
                (f"What is the occupation of {p.name}?", p.occupation),
                (f"What is the favourite colour of {p.name}?", p.color),
                (f"In which year was {p.name} born?", str(p.year)),
                (f"Which instrument does {p.name} play?", p.instrument),
                (f"Who employs {p.name}?", f"the {p.employer}"),
            )
        )
        return q, a, (index[p.name],)

    def examples(self, n: int, hops: int | None = None) -> Iterator[QAExample]:
        for _ in range(n):
            yield self.example(hops)


def corpus_text(n_prompts: int, seed: int = 0) -> Iterator[str]:
    """Training-split text for fitting the tokenizer: instructions, documents, questions, answers."""
    gen = QAGenerator("train", seed)
    for _ in range(n_prompts):
        exs = gen.prompt(4)
        yield exs[0].system + "".join(exs[0].documents)
        for ex in exs:
            yield ex.suffix + answer_text(ex.answer)


@dataclass(frozen=True)
class Turn:
    """One request of a conversation: the history of turn `parent` (that turn's own history, its
    question and its gold answer), then `example`'s question. parent None: no history."""

    example: QAExample
    parent: int | None
    line: int  # 0: the main line; b >= 1: the b-th branch


@dataclass(frozen=True)
class Conversation:
    """Turns over one set of documents: a main line, and branches that each leave it after one of
    its turns with other questions (a user editing or re-asking), in the order they are sent."""

    instruction: str
    documents: tuple[str, ...]
    turns: tuple[Turn, ...]

    @property
    def system(self) -> str:
        return self.instruction + "\n\n"

    def chain(self, t: int) -> list[int]:
        """The turns whose questions and answers make turn t's history, oldest first."""
        out, i = [], self.turns[t].parent
        while i is not None:
            out.append(i)
            i = self.turns[i].parent
        return out[::-1]

    def suffix_ids(self, t: int, encode) -> list[int]:
        """Turn t's suffix: its history (each question and gold answer, encoded part by part as
        training encodes them) and its own question."""
        ids: list[int] = []
        for i in self.chain(t):
            ex = self.turns[i].example
            ids += encode(ex.suffix) + encode(answer_text(ex.answer))
        return ids + encode(self.turns[t].example.suffix)

    def prompt_ids(self, t: int, encode) -> list[int]:
        return encode(self.system) + [i for d in self.documents for i in encode(d)] + self.suffix_ids(t, encode)

    def request(self, t: int, encode, max_new_tokens: int = 8) -> dict:
        """Turn t as an engine request (greedy, stops at the end of the line)."""
        return {
            "system": self.system,
            "segments": list(self.documents),
            "suffix": self.suffix_ids(t, encode),
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "stop": ["\n"]},
        }


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def restore_bounds(prompts: list[list[int]], answers: list[list[int]], t: int) -> tuple[int, int]:
    """Where a prefix cache of exact pages can resume request t at the earliest and the latest,
    in tokens (before rounding down to a page): the longest prefix of its prompt but the last token
    that an earlier request's prompt holds (always cached), and that its prompt plus its answer but
    the last token holds (cached when the model wrote the gold answer: the token that stops
    generation is sampled, never fed). answers[r]: request r's gold answer tokens, stop included."""
    target = prompts[t][:-1]
    lo = max((common_prefix_len(target, prompts[r]) for r in range(t)), default=0)
    hi = max((common_prefix_len(target, prompts[r] + answers[r][:-1]) for r in range(t)), default=0)
    return lo, hi


def restore_point(prompts, answers, t: int, page: int) -> int | None:
    """The page boundary (tokens) where a prefix cache of whole pages resumes request t whatever
    the model answered before it; None when that depends on the answers (a page ends inside one)."""
    lo, hi = restore_bounds(prompts, answers, t)
    return lo // page * page if lo // page == hi // page else None


def conversation(
    gen: QAGenerator,
    encode,
    turns: int = 6,
    branches: int = 2,
    branch_turns: int = 2,
    hops: int | None = None,
    page: int = 64,
    grid_pages: int = 4,
    attempts: int = 100,
) -> Conversation:
    """A conversation over one prompt's documents: `turns` turns on the main line, then `branches`
    branches of `branch_turns` turns, each leaving the main line after one of its turns but the
    last (the branch's first turn is another question after the same history). Questions (no
    repeats) and branch points are chosen so that every request but the first resumes, in a cache
    of `page`-token pages, at a page boundary that (a) does not depend on what the model answered
    before and (b) is off the grid of a dense checkpoint every `grid_pages` pages, so a checkpoint
    policy must fall back and a replay policy must replay. Documents where no choice does that for
    every request are set aside and others drawn (at most `attempts` times)."""
    if turns < 2 or branches < 0 or branch_turns < 1 or grid_pages < 2:
        raise ValueError("need turns >= 2, branches >= 0, branch_turns >= 1, grid_pages >= 2")
    for _ in range(attempts):
        conv = _try_conversation(gen, encode, turns, branches, branch_turns, hops, page, grid_pages)
        if conv is not None:
            return conv
    raise RuntimeError(f"no conversation of {turns} + {branches} x {branch_turns} turns met the page "
                       f"conditions in {attempts} draws of documents")


def _try_conversation(gen, encode, turns, branches, branch_turns, hops, page, grid_pages) -> Conversation | None:
    pool, seen = [], set()
    for ex in gen.prompt(4 * (turns + branches * branch_turns) + 8, hops):
        if ex.question not in seen:
            seen.add(ex.question)
            pool.append(ex)
    first = pool[0]
    base = len(encode(first.system)) + sum(len(encode(d)) for d in first.documents)
    # Every prompt starts with the same system prompt and documents: compare what follows them.
    chosen: list[Turn] = []
    suffixes: list[list[int]] = []
    answers: list[list[int]] = []
    encoded: dict[str, list[int]] = {}

    def enc(text: str) -> list[int]:
        if text not in encoded:
            encoded[text] = encode(text)
        return encoded[text]

    def fits(turn: Turn) -> tuple[list[int], list[int]] | None:
        history = [] if turn.parent is None else suffixes[turn.parent] + answers[turn.parent]
        suffix = history + enc(turn.example.suffix)
        answer = enc(answer_text(turn.example.answer))
        if chosen:
            lo, hi = restore_bounds(suffixes + [suffix], answers + [answer], len(suffixes))
            p, q = (base + lo) // page, (base + hi) // page
            if p != q or p == 0 or p % grid_pages == 0:
                return None
        # a later turn that continues this one resumes at this prompt's last page boundary: the
        # answer must not cross a page boundary, and that boundary must be off the grid
        end = base + len(suffix)
        p = end // page
        if p != (end + len(answer) - 1) // page or p % grid_pages == 0:
            return None
        return suffix, answer

    def add(options) -> bool:
        for turn in options:
            got = fits(turn)
            if got is not None:
                chosen.append(turn)
                suffixes.append(got[0])
                answers.append(got[1])
                pool.remove(turn.example)
                return True
        return False

    for t in range(turns):
        if not add(Turn(ex, t - 1 if t else None, 0) for ex in list(pool)):
            return None
    for b in range(1, branches + 1):
        points = list(range(turns - 1))
        gen.rng.shuffle(points)
        if not add(Turn(ex, j, b) for j in points for ex in list(pool)):
            return None
        for _ in range(branch_turns - 1):
            if not add(Turn(ex, len(chosen) - 1, b) for ex in list(pool)):
                return None
    return Conversation(first.instruction, first.documents, tuple(chosen))
