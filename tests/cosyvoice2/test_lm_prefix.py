"""A voice's LM prompt prefix ([sos | prompt_text] keys/values) reused instead of prefilled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from golden_bounds import LOGITS, Margins, assert_close_to_peak, compared_steps
from voicebot.tts.cosyvoice2.lm import CosyVoice2LM, generate, prompt_prefix
from voicebot.tts.cosyvoice2.loader import load_lm
from voicebot.tts.cosyvoice2.sampling import greedy

pytestmark = pytest.mark.golden


@pytest.fixture(scope="module")
def lm(cv2_dir: Path) -> CosyVoice2LM:
    return load_lm(cv2_dir)


def test_prefix_gives_the_golden_tokens_and_logits(lm: CosyVoice2LM, cv2_golden: dict, cv2_meta: dict) -> None:
    g, meta = cv2_golden, cv2_meta["lm.zero_shot"]
    prefix = prompt_prefix(lm, g["lm.prompt_text"])
    assert prefix.length == 1 + g["lm.prompt_text"].shape[1]
    logits: list[torch.Tensor] = []
    hook = lm.llm_decoder.register_forward_hook(lambda m, args, out: logits.append(out.detach().clone()))
    try:
        for _ in range(2):  # the prefix is reused, never written
            logits.clear()
            sampler = Margins(greedy)
            tokens = list(generate(lm, lm.new_cache(256), sampler, g["lm.text"], g["lm.prompt_text"],
                                   g["lm.prompt_speech_token"], meta["min_token_text_ratio"],
                                   meta["max_token_text_ratio"], prefix=prefix))
            expected = g["lm.zero_shot.step_logits"]
            steps = compared_steps(lm.speech_token_size, sampler, tokens, g["lm.zero_shot.greedy_tokens"].tolist(),
                                   expected)
            assert_close_to_peak(torch.cat(logits)[:steps], expected[:steps], LOGITS, "step logits")
    finally:
        hook.remove()


def test_prefix_of_another_prompt_is_refused(lm: CosyVoice2LM, cv2_golden: dict) -> None:
    prefix = prompt_prefix(lm, [1, 2, 3])
    with pytest.raises(ValueError, match="another prompt text"):
        next(generate(lm, lm.new_cache(256), greedy, cv2_golden["lm.text"], cv2_golden["lm.prompt_text"],
                      prefix=prefix))
