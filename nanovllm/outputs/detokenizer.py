"""Incremental detokenization and stop-string matching for one request.

OutputProcessor (outputs/output_processor.py) feeds each new token to the request's RequestText;
the text grows by the decoded difference of a small sliding token window, so a step costs
O(window), not O(output length).
"""


def added_token_texts(tokenizer) -> dict[int, str]:
    """The tokenizer's added tokens (specials included): id -> its text."""
    return {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}


def decode_text(tokenizer, token_ids: list[int], skip_special_tokens: bool,
                added_tokens: dict[int, str] | None = None) -> str:
    """tokenizer.decode; with added_tokens (spaces_between_special_tokens=False, vLLM's option), the
    runs between added tokens are decoded on their own and joined to the added tokens' texts with
    nothing between, so no space the decoder would put around a special token appears."""
    if added_tokens is None:
        return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    special = set(getattr(tokenizer, "all_special_ids", ()))
    pieces, run = [], []
    for token_id in token_ids:
        if token_id not in added_tokens:
            run.append(token_id)
            continue
        if skip_special_tokens and token_id in special:
            continue  # a skipped special token does not split the run around it
        if run:
            pieces.append(tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
            run = []
        pieces.append(added_tokens[token_id])
    if run:
        pieces.append(tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
    return "".join(pieces)


def find_stop(text: str, start: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends at or after text[start:], as (index, stop)."""
    best = None
    for stop in stops:
        i = text.find(stop, max(0, start - len(stop) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best


class IncrementalDetokenizer:
    """The completion's text so far. NOTE: its text equals tokenizer.decode(all tokens) for
    tokenizers whose decode of a window is a suffix-consistent piece of the whole (BPE, WordPiece,
    SentencePiece); a piece ending in an unfinished UTF-8 character waits for the next token."""

    def __init__(self, tokenizer, skip_special_tokens: bool, spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.added_tokens = None if spaces_between_special_tokens else added_token_texts(tokenizer)
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0  # window start: decoding from here gives context for the next piece
        self.read_offset = 0    # tokens before this are already in self.text

    def _decode(self, token_ids: list[int]) -> str:
        return decode_text(self.tokenizer, token_ids, self.skip_special_tokens, self.added_tokens)

    def _pending_piece(self) -> str:
        before = self._decode(self.token_ids[self.prefix_offset: self.read_offset])
        after = self._decode(self.token_ids[self.prefix_offset:])
        return after[len(before):]

    def add_token(self, token_id: int) -> int:
        """Append one token; returns the text length before it (where new text starts)."""
        start = len(self.text)
        self.token_ids.append(token_id)
        piece = self._pending_piece()
        if piece and not piece.endswith("\ufffd"):
            self.text += piece
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return start

    def full_text(self) -> str:
        """The text with whatever is still held back (an unfinished character); changes nothing."""
        if self.read_offset < len(self.token_ids):
            return self.text + self._pending_piece()
        return self.text


class RequestText:
    """One request's completion text, detokenized once: stop-string matching, the stream's deltas
    and the final output all read this one IncrementalDetokenizer."""

    def __init__(self, tokenizer, stops: list[str], skip_special_tokens: bool,
                 include_stop_str_in_output: bool, min_tokens: int, spaces_between_special_tokens: bool = True):
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self.stops = stops
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.final_text: str | None = None  # set when a stop string ends the request
        # NOTE: a stream holds back text that may be the start of a stop string until it cannot
        # be one, so it never sends text that the final output cuts off. A stop string kept in
        # the output needs no holding back: nothing after it is ever sent.
        held = [] if include_stop_str_in_output else stops
        self.holdback = max((len(s) for s in held), default=1) - 1

    def add_token(self, token_id: int, num_output_tokens: int) -> str | None:
        """Feed one output token; returns the stop string it completes, if any."""
        start = self.detokenizer.add_token(token_id)
        if not self.stops or num_output_tokens <= self.min_tokens:  # vLLM: no stops until past min_tokens
            return None
        hit = find_stop(self.detokenizer.text, start, self.stops)
        if hit is None:
            return None
        index, stop = hit
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.final_text = self.detokenizer.text[:end]
        return stop

    @property
    def text(self) -> str:
        """The whole text: the final one once a stop string matched, else everything so far."""
        if self.final_text is not None:
            return self.final_text
        return self.detokenizer.full_text()

    def streamable_text(self) -> str:
        """The text a running request's stream may have sent by now: whole characters only, less
        the tail that may still turn out to be the start of a stop string."""
        text = self.detokenizer.text
        return text[:max(0, len(text) - self.holdback)]
