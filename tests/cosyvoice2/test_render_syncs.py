"""A render (flow + HiFT of several streams' chunks) asks nothing of the device's results on the
host: no host sync, counted by bench/gpu_counts.py's DeviceWork (the counter bench/gpu_proxy.py
prints with), first and later chunks, one stream and several, noise drawn and not, in both serving
modes (fast: HiFTStream; exact: the official chunk vocoder's cross-fade), eager and at bucketed
shapes (what a CUDA graph captures must not read back either: a capture fails on a sync)."""

from __future__ import annotations

import pytest
import torch

from bench.gpu_counts import DeviceWork
from voicebot.tts.cosyvoice2.token2wav import FlowPrompt, Token2Wav

pytestmark = pytest.mark.golden


@pytest.mark.parametrize("bucketed", [False, True])
@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_a_render_waits_for_the_device_nowhere(t2w: Token2Wav, prompt: FlowPrompt, mode: str, bucketed: bool):
    if bucketed:
        t2w = Token2Wav(t2w.flow, t2w.hift, flow_left_chunks=1, bucketed=True)
    vocab = t2w.flow.input_embedding.num_embeddings
    g = torch.Generator().manual_seed(0)
    streams = [t2w.stream(prompt, zero_noise=i == 0, generator=torch.Generator().manual_seed(i), mode=mode)
               for i in range(3)]
    for s in streams:
        s.add(torch.randint(0, vocab, (400,), generator=g).tolist())
    for n in (1, 3, 3):  # one stream's first chunk, then three streams' chunks twice (cross-fades in exact)
        requests = [s.next_chunk() for s in streams[:n]]
        with DeviceWork() as work:
            audio = t2w.render(requests)
        assert work.syncs == {}, (n, dict(work.syncs))
        assert work.calls > 100 and all(a.shape[1] > 0 for a in audio)
