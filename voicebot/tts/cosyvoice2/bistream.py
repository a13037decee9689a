"""Bistream decoding (official Qwen2LM.inference_bistream, spec §6.4) as a push API.

Text arrives incrementally; the LM input interleaves blocks of mix_ratio = (5 text, 15 speech):
first the prompt speech tokens, then after every 15 generated tokens a forced (or sampled) fill
token pauses generation until 5 more text tokens have arrived. `push()` takes new text ids and
returns the program (lm.py) that decodes the speech tokens they unlock (every complete block, so the
steps do not depend on how the text was cut into pushes); `finish()` the program that
feeds the leftover text and task_id and decodes until eos. Each program must run to its end before
the next call; `lm.run_alone` runs one at batch 1, the LM pool many in one batch.

Where the official code raises on a special id that is not valid at that point (the unused
speech_token_size + 1 anywhere, a fill after the text has ended), those ids are masked before
sampling instead: a live reply should not die on one unlikely draw. Greedy outputs are the
official ones whenever the official code does not raise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from voicebot.tts.cosyvoice2.lm import MAX_TOKEN_TEXT_RATIO, CosyVoice2LM, Program, Step, token_ids


class Bistream:
    """One bistream request in a cache slot of `max_seq_len` positions."""

    def __init__(self, lm: CosyVoice2LM, max_seq_len: int,
                 prompt_text: Tensor | Sequence[int] | None = None,
                 prompt_speech: Tensor | Sequence[int] | None = None,
                 max_token_text_ratio: float = MAX_TOKEN_TEXT_RATIO) -> None:
        self.lm, self.max_seq_len = lm, max_seq_len
        self.device = lm.llm_decoder.weight.device
        self.max_token_text_ratio = max_token_text_ratio
        prompt_text, prompt_speech = token_ids(prompt_text, self.device), token_ids(prompt_speech, self.device)
        with torch.inference_mode():
            sos, self.task_id = lm.sos_task()
            # The official `lm_input`: what the next forward feeds. After a fill it still holds the
            # last speech token, already in the cache; finish() feeds it again, as the official code does.
            self.input = sos  # (1, n, D)
            self.text = lm.embed_text(prompt_text)  # (1, n, D) text not yet fed
            self.prompt = lm.embed_speech(prompt_speech)  # (1, m, D) prompt speech not yet fed
        n_speech, p = lm.mix_ratio[1], len(prompt_speech)
        self.next_fill = (p // n_speech + 1) * n_speech - p  # output index of the next forced fill
        self.pos = 0  # next cache position
        self.n_text = 0  # tts text tokens pushed
        self.out: list[int] = []  # every output, fills included: the sampler's history, as official
        self.truncated = False  # finish() stopped at its length limit or the cache's end, before eos

    def push(self, text: Tensor | Sequence[int]) -> Program:
        """Add text ids now; the returned program must run to its end before the next call."""
        ids = token_ids(text, self.device)
        self.n_text += len(ids)
        with torch.inference_mode():
            self.text = torch.cat([self.text, self.lm.embed_text(ids)], dim=1)
        return self._decode_with_text()

    @torch.inference_mode()
    def _decode_with_text(self) -> Program:
        lm, (n_text, n_speech) = self.lm, self.lm.mix_ratio
        while self.prompt.shape[1] and self.text.shape[1] >= n_text:
            self.input = torch.cat([self.input, self.text[:, :n_text], self.prompt[:, :n_speech]], dim=1)
            self.text, self.prompt = self.text[:, n_text:], self.prompt[:, n_speech:]
        if self.prompt.shape[1]:
            return
        # Every block of n_text tokens the text now holds is decoded, as the official loop does
        # when fed one token at a time: however the text was cut into pushes, the same steps.
        while True:
            after_fill = bool(self.out) and self.out[-1] == lm.fill_token
            if after_fill or (not self.out and self.input.shape[1] == 1):
                if self.text.shape[1] < n_text:
                    return
                block, self.text = self.text[:, :n_text], self.text[:, n_text:]
                self.input = block if after_fill else torch.cat([self.input, block], dim=1)
            while True:  # speech tokens until the fill
                forced = lm.fill_token if len(self.out) == self.next_fill else None
                token = yield self._step(banned=(lm.eos, lm.eos + 1), forced=forced)
                self.out.append(token)
                if token == lm.fill_token:
                    self.next_fill = len(self.out) + n_speech
                    break
                yield token
                self.input = lm.speech_embedding.weight[token].reshape(1, 1, -1)

    @torch.inference_mode()
    def finish(self) -> Program:
        """No more text: decode until eos, at most int(n_text·max_ratio) speech tokens in all (the
        official code has no limit) and never past the end of the slot."""
        lm = self.lm
        self.input = torch.cat([self.input, self.text, self.task_id], dim=1)
        self.text = self.text[:, :0]
        n_speech = sum(t < lm.speech_token_size for t in self.out)
        limit = int(self.n_text * self.max_token_text_ratio)
        self.truncated = True  # until eos is sampled
        while n_speech < limit and self.pos + self.input.shape[1] <= self.max_seq_len:
            token = yield self._step(banned=(lm.eos + 1, lm.fill_token))
            self.out.append(token)
            if token == lm.eos:
                self.truncated = False
                return
            yield token
            n_speech += 1
            self.input = lm.speech_embedding.weight[token].reshape(1, 1, -1)

    def _step(self, banned: tuple[int, ...], forced: int | None = None) -> Step:
        n = self.input.shape[1]
        if self.pos + n > self.max_seq_len:
            raise RuntimeError(f"KV cache of {self.max_seq_len} positions is full; split the text")
        step = Step(self.input, self.pos, self.out, banned, forced)
        self.pos += n
        return step
