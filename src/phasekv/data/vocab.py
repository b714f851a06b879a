"""The synthetic word-level vocabulary shared by training data and evaluation prompts.

Every token id is one readable word, so any prompt decodes to text a person can check.  Ids are
contiguous per group, in the order of `GROUPS`:

    specials    "<bos>" (starts every sequence) and "<pad>" (never placed in a sequence by
                phasekv; it exists so that a runner that must pad a batch has an id that is not a
                word; padding has to be masked and must not shift positions, see docs/architecture.md)
    keys        animal names, the record keys ("cat", "otter", ...)
    values      person names, the record values ("Alice", ...)
    fillers     neutral filler words ("um", "so", "well", ...); all padding is real filler tokens
    background  ordinary words, the states of the background-text Markov chain

When a group needs more words than the lists below hold, further words are generated
deterministically as hyphenated pairs of base words ("cat-dog", "Alice-Bob"), never random strings.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import product
from typing import Any

GROUPS = ("specials", "keys", "values", "fillers", "background")
SPECIALS = ("<bos>", "<pad>")

_ANIMALS = """
cat dog otter fox wolf bear lion tiger horse zebra camel llama goat sheep cow pig mouse rat rabbit hare
deer moose elk bison yak panda koala lemur monkey gorilla sloth badger beaver mole hedgehog squirrel
ferret weasel mink skunk raccoon possum seal walrus whale dolphin shark salmon trout eel crab lobster
shrimp squid octopus snail frog toad newt lizard gecko iguana snake cobra turtle tortoise crocodile
eagle hawk falcon owl crow raven robin sparrow finch parrot pigeon swan goose duck heron stork pelican
penguin ostrich emu bee wasp ant beetle moth spider
"""

_NAMES = """
Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Leo Maria Nathan Olivia Peter Quinn
Rachel Sam Tina Umar Vera Walter Xena Yusuf Zoe Adam Bella Carl Diana Ethan Fiona George Hannah Ivan
Julia Kevin Laura Mark Nina Oscar Paula Ray Sara Tom Ursula Victor Wendy Yara Zack Amir Beth Chris
Dora Eric Flora Gavin Helen Igor Jane Kyle Lucy Mike Nora Omar Pia Rosa Simon Tara Uma Vince Will Yuki
Zara Anna Ben Clara Dan Elsa Felix
"""

_FILLERS = """
um uh er erm hmm mhm ah oh so well like okay alright anyway actually basically literally honestly
yeah right hey huh ooh meh
"""

_BACKGROUND = """
the a of and to in is was it for on with as at by from this that they we you he she are were be has
had have not but or an all some many more most other new old good small large long short first last
time day year way thing place world house city water road book table door window tree river hill
stone light night morning evening work word song story letter garden market school friend family
child people go come make take give find walk read write sing open close bring keep hold turn leave
went said under over near after before
"""

BASE_WORDS = {g: text.split() for g, text in
         {"keys": _ANIMALS, "values": _NAMES, "fillers": _FILLERS, "background": _BACKGROUND}.items()}


def numbered_words(base: Sequence[str], n: int) -> list[str]:
    """The first n words of `base` followed by the hyphenated pairs "a-b" (a != b), in a fixed order."""
    out = list(base[:n])
    for a, b in product(base, base):
        if len(out) >= n:
            break
        if a != b:
            out.append(f"{a}-{b}")
    if len(out) < n:
        raise ValueError(f"cannot generate {n} words from {len(base)} base words")
    return out


class Vocabulary:
    """Word <-> id mapping with named groups.

    `Vocabulary(n_keys, n_values, n_fillers, n_background)` builds the default word lists;
    `from_dict(to_dict())` restores exactly the same ids (a checkpoint stores its vocabulary as JSON).
    """

    header: tuple[int, ...] = ()  # the synthetic task has no framing around its records
    tail: tuple[int, ...] = ()
    haystack_tokens = 0  # no prose between the records (see phasekv.data.formats for the needle format)

    def __init__(self, n_keys: int = 64, n_values: int = 64, n_fillers: int = 16, n_background: int = 64):
        sizes = {"keys": n_keys, "values": n_values, "fillers": n_fillers, "background": n_background}
        for name, n in sizes.items():
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"n_{name}: must be a positive integer, got {n!r}")
        self._init({"specials": list(SPECIALS), **{g: numbered_words(BASE_WORDS[g], n) for g, n in sizes.items()}})

    def _init(self, groups: Mapping[str, Sequence[str]]) -> None:
        if sorted(groups) != sorted(GROUPS):
            raise ValueError(f"vocabulary groups: expected {list(GROUPS)}, got {sorted(groups)}")
        self.words: list[str] = []
        self._groups: dict[str, list[int]] = {}
        for name in GROUPS:
            start = len(self.words)
            self.words.extend(groups[name])
            self._groups[name] = list(range(start, len(self.words)))
        self._ids = {w: i for i, w in enumerate(self.words)}
        if len(self._ids) != len(self.words):
            raise ValueError("vocabulary: words must be unique across all groups")
        bad = [w for w in self.words if not w or any(c.isspace() for c in w)]
        if bad:
            raise ValueError(f"vocabulary: words must be non-empty and contain no whitespace, got {bad[0]!r}")
        if list(groups["specials"][:1]) != ["<bos>"]:
            raise ValueError("vocabulary specials: the first special must be '<bos>'")

    @classmethod
    def from_data_config(cls, config: Any) -> Vocabulary:
        """The vocabulary a `DataConfig` asks for (its n_keys, n_values, n_fillers, n_background)."""
        return cls(config.n_keys, config.n_values, config.n_fillers, config.n_background)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Vocabulary:
        groups = data.get("groups") if isinstance(data, Mapping) else None
        if not isinstance(groups, Mapping):
            raise ValueError("vocabulary: expected a mapping with a 'groups' mapping")
        vocab = cls.__new__(cls)
        vocab._init({name: list(words) for name, words in groups.items()})
        return vocab

    def to_dict(self) -> dict[str, Any]:
        return {"groups": {name: [self.words[i] for i in ids] for name, ids in self._groups.items()}}

    @property
    def size(self) -> int:
        return len(self.words)

    def __len__(self) -> int:
        return len(self.words)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and self.to_dict() == other.to_dict()

    @property
    def bos(self) -> int:
        return self._groups["specials"][0]

    def group(self, name: str) -> list[int]:
        """Ids of one group, in id order."""
        if name not in self._groups:
            raise ValueError(f"group: unknown {name!r}; known: {list(GROUPS)}")
        return list(self._groups[name])

    def group_of(self, token: int) -> str:
        for name, ids in self._groups.items():
            if ids and ids[0] <= token <= ids[-1]:
                return name
        raise ValueError(f"token id {token} is outside the vocabulary (size {self.size})")

    def encode(self, words: str | Iterable[str]) -> list[int]:
        """Ids of whitespace-separated words (a string) or of a sequence of words."""
        items = words.split() if isinstance(words, str) else list(words)
        unknown = [w for w in items if w not in self._ids]
        if unknown:
            raise ValueError(f"encode: unknown word {unknown[0]!r}")
        return [self._ids[w] for w in items]

    def decode(self, ids: Iterable[int]) -> str:
        """The words of `ids` joined by single spaces."""
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.words):
                raise ValueError(f"decode: token id {i} is outside the vocabulary (size {self.size})")
            out.append(self.words[i])
        return " ".join(out)
