"""The one bank of built-in prompts (no downloads): for demos, the load generator and the benchmarks.

* :func:`chat_prompts`: single-turn chats, varied topics and phrasings (``python -m engine --num-prompts``,
  ``python -m bench``'s built-in workload and its decode-step profile);
* :func:`synthetic_chat`: the playground's load generator (``ui/loadgen.py``): prompts from one line to a
  long preamble, with 16..256 new tokens each;
* :func:`plain_prompts`: one-line plain-text prompts, no chat template (``python -m bench.kernels --engine``);
* :func:`mixed_max_tokens`: output lengths (tokens) drawn uniformly, as the reference workload W64 does.

Every function is deterministic for its seed (or the ``random.Random`` it is given).
"""

from __future__ import annotations

import random

# ------------------------------------------------------------------------------------------------
# chat prompts (the engine's CLI and the bench)
# ------------------------------------------------------------------------------------------------
TOPICS = [
    "volcanoes", "the moon", "honeybees", "the Roman Empire", "black holes", "photosynthesis", "the ocean",
    "rainbows", "dinosaurs", "the internet", "coffee", "the Great Wall of China", "penguins", "electricity",
    "the human heart", "chess", "jazz music", "glaciers", "the printing press", "octopuses", "deserts",
    "the solar system", "bread baking", "earthquakes", "owls", "the Olympic Games", "clouds", "bicycles",
    "the Amazon rainforest", "magnets", "tea", "the Renaissance", "whales", "lightning", "origami",
    "the pyramids of Egypt", "butterflies", "gravity", "libraries", "mountains", "trains", "coral reefs",
    "the violin", "snow", "ancient Greece", "robots", "elephants", "the wind", "maps", "volcanic islands",
    "the Silk Road", "sharks", "telescopes", "forests", "hot air balloons", "the alphabet", "tigers",
    "rivers", "the compass", "frogs", "the stars", "pizza", "bridges", "the seasons",
]
TEMPLATES = [
    "Tell me about {topic}.",
    "Explain {topic} to a child.",
    "Write a short paragraph about {topic}.",
    "What are three interesting facts about {topic}?",
]


def chat_prompts(n: int, seed: int = 0) -> list[list[dict]]:
    """``n`` single-turn chat prompts (lists of ``{"role", "content"}``), varied topics and phrasings,
    deterministic for a ``seed``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        topic = TOPICS[(i + seed) % len(TOPICS)]
        out.append([{"role": "user", "content": rng.choice(TEMPLATES).format(topic=topic)}])
    return out


def mixed_max_tokens(n: int, low: int = 16, high: int = 256, seed: int = 20261129) -> list[int]:
    """``n`` output lengths (tokens) drawn uniformly from ``[low, high]`` with a fixed seed (as the
    reference workload W64 does)."""
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(n)]


# ------------------------------------------------------------------------------------------------
# the load generator's chats: one line to a long preamble
# ------------------------------------------------------------------------------------------------
LOAD_TOPICS = [
    "the ocean", "volcanoes", "honey bees", "the Roman Empire", "black holes", "coffee", "chess", "the moon",
    "rainforests", "bicycles", "jazz", "origami", "glaciers", "the printing press", "octopuses", "tea",
    "kimchi", "Hangul, the Korean alphabet", "lighthouses", "trains", "photosynthesis", "the internet",
    "penguins", "paper money",
]
LOAD_PHRASINGS = [
    "Tell me about {topic}.",
    "Write a short poem about {topic}.",
    "Explain {topic} to a ten-year-old in a few sentences.",
    "Give me three surprising facts about {topic}.",
    "What is one common misconception about {topic}? Answer in one sentence.",
    "Write a long, detailed essay about {topic}, with an introduction, three sections and a conclusion.",
]
LONG_PREAMBLE = (
    "Continuous batching lets an inference server add a new request to the running batch as soon as "
    "another one finishes, instead of waiting for the whole batch. Paged attention stores the key and value "
    "vectors of every request in fixed-size blocks, like pages of virtual memory, so memory is handed out a "
    "block at a time and returned as soon as a request ends. Together they keep the accelerator busy and "
    "let many more requests share the same memory. "
)


def synthetic_chat(rng: random.Random) -> tuple[list[dict[str, str]], int]:
    """One synthetic chat: its messages and its ``max_tokens`` (16..256), drawn from ``rng``.

    About one in five carries a long preamble (1 to 4 copies of :data:`LONG_PREAMBLE`: a long prompt, so
    a long prefill).
    """
    prompt = rng.choice(LOAD_PHRASINGS).format(topic=rng.choice(LOAD_TOPICS))
    if rng.random() < 0.2:
        prompt = LONG_PREAMBLE * rng.randint(1, 4) + "\n\nNow, unrelated: " + prompt
    return [{"role": "user", "content": prompt}], rng.randint(16, 256)


# ------------------------------------------------------------------------------------------------
# plain-text one-liners (the kernel bench's end-to-end run)
# ------------------------------------------------------------------------------------------------
SHORT_TOPICS = [
    "volcanoes", "the moon", "honey bees", "the Roman empire", "black holes", "coffee", "glaciers", "jazz",
    "photosynthesis", "the printing press", "octopuses", "rainbows", "the Silk Road", "chess", "tides",
    "the human heart", "sourdough bread", "lighthouses", "the Sahara", "penguins",
]


def plain_prompts(n: int) -> list[str]:
    """``n`` one-line plain-text prompts (``"Tell me about volcanoes."``, ...); past the
    :data:`SHORT_TOPICS` they repeat with a ``" (part k)"`` suffix, so all ``n`` are distinct."""
    k = len(SHORT_TOPICS)
    return [f"Tell me about {SHORT_TOPICS[i % k]}." + (f" (part {i // k + 1})" if i >= k else "") for i in range(n)]
