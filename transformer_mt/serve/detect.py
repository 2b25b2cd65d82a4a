"""Which of a model's source languages a text is written in: LibreTranslate's ``source: "auto"`` and ``/detect``.

py3langid (langid.py's naive Bayes model of 97 languages, trained on
several corpora, in a few MB of numpy) chooses among the model's source
languages only: a text of another language is answered with the closest
one the model can translate, as LibreTranslate does. A model of one source
language needs no identifier: every text is in that language.
"""

from __future__ import annotations

from typing import Any

from transformer_mt.errors import UserError

INSTALL = "pip install py3langid (or the serve extra: pip install 'transformer_mt[serve]')"


class DetectError(UserError):
    """Language identification is needed but py3langid is not installed; the message says how to install it."""


class LanguageDetector:
    """The identifier of one model's source languages, loaded once per server."""

    def __init__(self, languages: list[str]) -> None:
        self.languages = languages
        self._identifier: Any = None
        if len(languages) > 1:
            try:
                from py3langid.langid import MODEL_FILE, LanguageIdentifier
            except ImportError:
                raise DetectError(f"serving several source languages needs a language identifier: {INSTALL}") from None
            identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
            known = [lang for lang in languages if lang in identifier.nb_classes]
            if len(known) > 1:  # codes it does not know (zh_Hant) are never detected; one known: nothing to choose
                identifier.set_languages(known)
                self._identifier = identifier

    def detect(self, text: str) -> dict[str, Any]:
        """LibreTranslate's ``{"confidence": 0-100, "language": code}`` for ``text``: the likeliest source."""
        if self._identifier is None or not text.strip():
            return {"confidence": 100.0 if self._identifier is None else 0.0, "language": self.languages[0]}
        language, probability = self._identifier.classify(text)
        return {"confidence": round(100.0 * float(probability), 2), "language": str(language)}
