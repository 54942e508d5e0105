"""Built-in, varied chat prompts for demos, the load generator and benchmarks (no downloads)."""

from __future__ import annotations

import random

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
