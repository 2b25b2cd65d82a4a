"""The models one server holds, and which of them answers a request.

A server holds one model (of one pair, or of several directions), or
several models of other directions side by side: ``tmt serve -c en_de.pt -c
de_en.pt`` answers both directions behind one API, as a LibreTranslate
server answers the pairs of its packages. Each request goes to the one
model that translates its source into its target (`Models.route`); the
worker keeps one running search per model (`transformer_mt.serve.batcher`).
Two models of one pair would make the answer depend on which was asked, so
a server refuses to start with them; one decoding setting for the whole
server (the models' decode sections must agree) keeps `/health`, the
request checks and ``alternatives`` the same whichever model answers.

With a pivot (``tmt serve --pivot en``), a pair that no model was trained
on is answered in two legs through the pivot, each leg by its own model
(`Models.legs`): ``-c de_en.pt -c en_fr.pt --pivot en`` answers de-fr, as
Argos Translate's packages behind LibreTranslate do, and a model of several
directions answers its untrained pairs through the pivot instead of
zero-shot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from transformer_mt.data.directions import Direction, directions
from transformer_mt.decode.translate import Translator
from transformer_mt.errors import UserError
from transformer_mt.serve.protocol import Languages, RequestError


class ModelsError(UserError):
    """Models that cannot be served together: two of one pair, or decoding settings that differ."""


class Models:
    """The server's translators (the first's settings are the server's) and the languages they answer."""

    def __init__(self, translators: Sequence[Translator], names: Sequence[str] = (), pivot: str | None = None) -> None:
        if not translators:
            raise ModelsError("a server needs a model: pass a checkpoint with -c")
        self.translators = list(translators)
        self.names = list(names) or [f"model {i + 1}" for i in range(len(translators))]
        self.languages = Languages.of(*(t.cfg.data for t in self.translators))
        self.pivot = pivot
        self._trained = set(self.directions())
        self.pivoted = frozenset() if pivot is None else self._pivoted(pivot)  # the pairs answered in two legs
        if pivot is not None:
            self.languages = dataclasses.replace(self.languages, pairs=self.languages.pairs | self.pivoted)
            if self.first.cfg.decode.alignment != "none":
                raise ModelsError(
                    f"--pivot with decode.alignment={self.first.cfg.decode.alignment}: a pair answered through the "
                    "pivot has no word alignment with its source; serve without one of them"
                )
        self._owner: dict[tuple[str, str], int] = {}
        for i, translator in enumerate(self.translators):
            for pair in sorted(Languages.of(translator.cfg.data).pairs):
                if pair in self._owner:
                    raise ModelsError(
                        f"{self.names[self._owner[pair]]} and {self.names[i]} both translate {pair[0]}-{pair[1]}: "
                        "serve each direction from one model (average the two with tmt average, or serve one)"
                    )
                self._owner[pair] = i
        self._check_same_decoding()

    @property
    def first(self) -> Translator:
        return self.translators[0]

    def directions(self) -> list[Direction]:
        """The directions the models were trained on, model by model in the server's order."""
        return [way for translator in self.translators for way in directions(translator.cfg.data)]

    def _pivoted(self, pivot: str) -> frozenset[tuple[str, str]]:
        """The pairs no model was trained on that go through ``pivot`` on two trained legs, which `/languages`
        then offers; a pivot that is not a source and a target of the models is a ModelsError naming theirs,
        at start rather than as a 400 on every such request."""
        langs = self.languages
        if pivot not in langs.sources or pivot not in langs.targets:
            raise ModelsError(
                f"--pivot {pivot}: a pivot must be translated into and out of; these models translate from "
                f"{', '.join(langs.sources)} into {', '.join(langs.targets)}"
            )
        return frozenset(
            (s, t) for s in langs.sources for t in langs.targets
            if len({s, t, pivot}) == 3 and len(self.legs(s, t)) == 2
        )  # fmt: skip

    def legs(self, source: str | None, target: str | None) -> list[tuple[str | None, str | None]]:
        """The directions a request of ``source`` into ``target`` is translated in: itself, or, for a pair no
        model was trained on whose legs through the pivot both were, those two legs: a trained pair is always
        answered by its own model, the better route. A source left open (texts found in several languages) has
        no legs to choose, so it is translated directly."""
        pivot, trained = self.pivot, self._trained
        if pivot is None or source is None or target is None or Direction(source, target) in trained:
            return [(source, target)]
        if Direction(source, pivot) in trained and Direction(pivot, target) in trained:
            return [(source, pivot), (pivot, target)]
        return [(source, target)]

    def _check_same_decoding(self) -> None:
        first = dataclasses.asdict(self.first.cfg.decode)
        for name, translator in zip(self.names[1:], self.translators[1:], strict=True):
            for key, value in dataclasses.asdict(translator.cfg.decode).items():
                if value != first[key]:
                    raise ModelsError(
                        f"{self.names[0]} decodes with decode.{key}={first[key]!r} and {name} with {value!r}: a "
                        f"server decodes every model alike; give both the same with --set decode.{key}=..."
                    )

    def route(self, source: str | None, target: str | None) -> int:
        """The index of the model that translates ``source`` into ``target`` (the request's languages, already
        checked against `languages`); a source left open (auto) needs no choice unless several models
        translate into the target, which is a 400 asking for it."""
        if len(self.translators) == 1:
            return 0
        if source is not None and target is not None:
            return self._owner[(source, target)]
        owners = {i for (s, t), i in self._owner.items() if target is None or t == target}
        if len(owners) == 1:
            return owners.pop()
        froms = ", ".join(repr(s) for s in self.languages.sources_into(target)) if target else ""
        raise RequestError(
            400, f"several models here translate into {target!r} (from {froms}) and the texts' language was not "
            "found alike in all of them: name 'source', or send texts of one language per request", "source",
        )  # fmt: skip
