"""On CUDA, the default mode (no ``--batch-invariant``) against the batch-invariant one: the same target
request alone and beside random neighbours, in both modes, on the SmolLM2-shaped random-weight model of
``tests/test_batch_invariance_cuda.py`` (on CPU without CUDA, as a smoke run). Prints, per mode, whether the target's tokens and
log-probabilities were equal to its solo run (the batch-invariant rows must always be). Device check only:

    python scripts/gpu_invariance_default_mode.py [trials]
"""

import random
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, ".")
from engine.request import SamplingParams  # noqa: E402
from tests.conftest import run_beside_neighbours, word_tokenizer  # noqa: E402

VOCAB = 2048


def main(trials: int) -> None:
    tok = word_tokenizer(VOCAB)
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(3)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                          tie_word_embeddings=True)
        model = LlamaForCausalLM(cfg).to(device="cuda" if torch.cuda.is_available() else "cpu", dtype=dtype).eval()
        rng = random.Random(0)
        counts = {True: [0, 0, 0], False: [0, 0, 0]}  # mode -> [tokens equal, logprobs equal, trials]
        for t in range(trials):
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 700))]
            neighbours = [([rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 300))],
                           SamplingParams(temperature=0.9, max_tokens=rng.randint(1, 12), ignore_eos=True))
                          for _ in range(rng.randint(1, 63))]
            target = SamplingParams(temperature=0.8, seed=t, max_tokens=10, ignore_eos=True, logprobs=0)
            budget = rng.choice([8192, 64, 512])
            after, twice = rng.randint(0, 3), rng.random() < 0.5  # the same mix for both modes
            for bi in (True, False):
                alone = run_beside_neighbours(model, tok, prompt, target, [], dict(num_blocks=512, enable_prefix_caching=False),
                                              0, False, batch_invariant=bi)
                mixed = run_beside_neighbours(model, tok, prompt, target, neighbours,
                                              dict(num_blocks=2048, max_num_batched_tokens=budget,
                                                   prefill_chunk_tokens=min(budget, 256)),
                                              after, twice, batch_invariant=bi)
                c = counts[bi]
                c[0] += alone[0] == mixed[0]
                c[1] += alone[1] == mixed[1]
                c[2] += 1
            print(f"  {dtype} trial {t}: {len(neighbours)} neighbours, budget {budget}", flush=True)
        for bi, (tok_eq, lp_eq, n) in counts.items():
            mode = "batch-invariant" if bi else "default"
            print(f"{str(dtype):15} {mode:16} tokens equal {tok_eq}/{n}  logprobs bit-equal {lp_eq}/{n}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 12)
