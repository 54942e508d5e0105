"""On CUDA, the default mode (no ``--batch-invariant``) against the batch-invariant one: the same target
request alone and beside random neighbours, in both modes, on the SmolLM2-shaped random-weight model of
``tests/test_batch_invariance_cuda.py`` (on CPU without CUDA, as a smoke run). Prints, per mode, whether the target's tokens and
log-probabilities were equal to its solo run (the batch-invariant rows must always be). Device check only:

    python scripts/gpu_invariance_default_mode.py [trials]
"""

import random
import sys

import torch

sys.path.insert(0, ".")
from tests.conftest import invariance_target, smollm2_shaped_model, target_alone_and_beside, word_tokenizer  # noqa: E402

VOCAB = 2048


def main(trials: int) -> None:
    tok = word_tokenizer(VOCAB)
    for dtype in (torch.bfloat16, torch.float32):
        model = smollm2_shaped_model(VOCAB, 2, 2048, seed=3, device="cuda" if torch.cuda.is_available() else "cpu",
                                     dtype=dtype)
        rng = random.Random(0)
        counts = {True: [0, 0, 0], False: [0, 0, 0]}  # mode -> [tokens equal, logprobs equal, trials]
        for t in range(trials):
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 700))]
            neighbours = [([rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 300))], rng.randint(1, 12), 0.9)
                          for _ in range(rng.randint(1, 63))]
            target = invariance_target(False, t)
            budget = rng.choice([8192, 64, 512])
            after, twice = rng.randint(0, 3), rng.random() < 0.5  # the same mix for both modes
            for bi in (True, False):
                alone, mixed = target_alone_and_beside(model, tok, prompt, target, neighbours, alone_blocks=512,
                                                       mixed_blocks=2048, budget=budget, chunk_cap=256, after=after,
                                                       twice=twice, batch_invariant=bi)
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
