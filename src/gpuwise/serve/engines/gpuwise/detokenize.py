"""A sequence's text, grown a token at a time at a cost that does not grow with the output.

Decoding the whole output again at every token (what the engine did) costs in proportion to its length: 36 us at
64 tokens, 0.46 ms at 1,024 on SmolLM2's tokenizer, for every stream at every step. `IncrementalText` decodes a
window of the last few ids instead (vLLM's incremental detokenization, `detokenize_incrementally`): the ids since
the text last grew and those of the piece before them, whose text is known. The piece before is there so that
what a tokenizer does across a boundary (a leading space it drops at the start of a text, spaces it cleans up
before punctuation) is done the same way the whole decode does it. A window whose text ends in U+FFFD, half of
a multi-byte character, waits for the ids that complete it.

Why not transformers' `TextStreamer`: it decodes from the last line break on, which in a text without one is
the whole output again.
"""

from __future__ import annotations

from typing import Any


class IncrementalText:
    """The text of `ids` so far as `tok.decode(ids, skip_special_tokens=True)` gives it, where that ends in a whole
    character; `add` each new id."""

    def __init__(self, tok: Any) -> None:  # a transformers tokenizer: anything with decode(ids, skip_special_tokens)
        self.tok = tok
        self.ids: list[int] = []
        self.text = ""  # the text of ids[:read]
        self.prefix = 0  # the window's start: the piece before the ids not yet in the text
        self.read = 0  # ids in the text

    def add(self, token: int) -> str:
        """The text with `token` appended: as long as before where the window ends in half a character."""
        self.ids.append(token)
        grown = self._grown()
        if grown and not grown.endswith("\ufffd"):
            self.text += grown
            self.prefix, self.read = self.read, len(self.ids)
        return self.text

    def whole(self) -> str:
        """The text of every id added, half a character at its end included (as U+FFFD): the output's last text."""
        return self.text if self.read == len(self.ids) else self.text + self._grown()

    def _grown(self) -> str:
        """The text the ids not yet in it add: the window decoded, less the text of the piece before them.

        Two decodes a token, as vLLM's: the piece before's text cannot be kept from the last one, whose window
        started a piece earlier (a tokenizer's cleanup can differ at the window's start)."""
        known = self.tok.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        return self.tok.decode(self.ids[self.prefix :], skip_special_tokens=True)[len(known) :]
