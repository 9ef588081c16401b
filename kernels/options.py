"""Backend options: `NAME@WORD+WORD`, each word setting one constructor flag of NAME's class.

A backend class declares its flags as `options = {keyword: option}` (Choice, Number, Rest) and
parse_options() is the one parser: Backend.from_option(text) is `cls(**parse_options(...))`. Words are
joined by '+'; '@' and '-' join too, as in `flashinfer-packed@bsr@p16` and
`dense-masked@efficient-expand`. A word sets every flag whose option takes it (`plain` turns both of
q-packed-cute's off); a word no option takes goes to the backend's Rest option, where it has one. An
empty word, a flag set twice, a word no option takes or a value an option refuses is a ValueError of one
line that names the backend's options.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from ..roofline.names import option_words


@dataclass(frozen=True)
class Choice:
    """A flag set by one of `words` (a tuple: the word is the value; a dict: word -> value). `refuses`: a
    regex of further words it takes only to refuse them by name ("v99": a kernel that is not built)."""
    what: str
    words: tuple | dict
    refuses: str = ""
    rest = False

    def _values(self) -> dict:
        return self.words if isinstance(self.words, dict) else {w: w for w in self.words}

    def takes(self, word: str) -> bool:
        return word in self._values() or bool(self.refuses and re.fullmatch(self.refuses, word))

    def value(self, word: str, backend: str):
        if word not in self._values():
            raise ValueError(f"{backend} has no {self.what} {word!r}")
        return self._values()[word]

    def examples(self) -> tuple[str, ...]:
        return tuple(self._values())

    def spelling(self) -> str:
        return "|".join(self._values())


@dataclass(frozen=True)
class Number:
    """A flag set by PREFIX<n> to the integer n, one of `numbers`."""
    what: str
    prefix: str
    numbers: tuple[int, ...]
    rest = False

    def takes(self, word: str) -> bool:
        return word.startswith(self.prefix) and word[len(self.prefix):].isdigit()

    def value(self, word: str, backend: str) -> int:
        n = int(word[len(self.prefix):])
        if n not in self.numbers:
            raise ValueError(f"{backend} has no {self.what} {word!r}")
        return n

    def examples(self) -> tuple[str, ...]:
        return tuple(f"{self.prefix}{n}" for n in self.numbers)

    def spelling(self) -> str:
        lo, hi = min(self.numbers), max(self.numbers)
        if len(self.numbers) > 3 and tuple(self.numbers) == tuple(range(lo, hi + 1)):
            return f"{self.prefix}{lo}..{self.prefix}{hi}"
        return "|".join(self.examples())


@dataclass(frozen=True)
class Rest:
    """The flag every word no other option takes sets: parse(word) is its value, or ValueError saying
    what the notation is. `notation` and `samples` show it in messages and tests."""
    what: str
    parse: Callable[[str], Any]
    notation: str
    samples: tuple[str, ...]
    rest = True

    def takes(self, word: str) -> bool:
        return True

    def value(self, word: str, backend: str):
        try:
            return self.parse(word)
        except ValueError as exc:
            raise ValueError(f"{backend}: {exc}") from None

    def examples(self) -> tuple[str, ...]:
        return self.samples

    def spelling(self) -> str:
        return self.notation


Option = Choice | Number | Rest


def describe_options(backend: str, options: dict[str, Option]) -> str:
    """'NAME options are p8|p16 (tile size), ..., joined by '+''."""
    listed = ", ".join(f"{o.spelling()} ({o.what})" for o in options.values())
    return f"{backend} options are {listed}, joined by '+'"


def parse_options(backend: str, options: dict[str, Option], text: str) -> dict[str, Any]:
    """The constructor keywords `backend@text` sets (module docstring); ValueError, one line, otherwise."""
    if not options:
        raise ValueError(f"backend {backend!r} takes no @option but a planted delay, {backend}@delayP "
                         f"(got '{backend}@{text}')")
    rest = [key for key, o in options.items() if o.rest]
    kwargs: dict[str, Any] = {}
    try:
        for word in option_words(text):
            if not word:
                raise ValueError(f"{backend}@{text} has an empty option")
            keys = [key for key, o in options.items() if not o.rest and o.takes(word)] or rest
            if not keys:
                raise ValueError(f"{backend} has no option {word!r}")
            for key in keys:
                if key in kwargs:
                    raise ValueError(f"{backend}@{text} sets its {options[key].what} twice")
                kwargs[key] = options[key].value(word, backend)
    except ValueError as exc:
        raise ValueError(f"{exc}; {describe_options(backend, options)}") from None
    return kwargs
