"""Write data/writing_prompts.jsonl: short open-ended writing prompts (hand-written, no source corpus).

Each asks for a short piece (a few sentences) so a 135M model can answer within ~64-128 tokens and
the answers can differ in content, not only in wording: good material for diversity vs quality.

    python data/make_writing_prompts.py [--out data/writing_prompts.jsonl]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

PROMPTS = [
    "Write the opening lines of a story about a lighthouse keeper who finds a letter in a bottle.",
    "Describe a city market early on a rainy morning.",
    "Write a short story about a robot that learns to bake bread.",
    "Describe the view from the top of a mountain at sunrise.",
    "Write a short fable about a fox and a crow who become friends.",
    "Tell a story about a child who discovers a secret door in the library.",
    "Describe an old kitchen and the smells in it.",
    "Write a short story that begins with a phone ringing at midnight.",
    "Describe a train journey through snowy hills.",
    "Write a story about a gardener who grows a plant nobody has seen before.",
    "Describe a busy harbour from the point of view of a seagull.",
    "Write a short story about two strangers sharing an umbrella.",
    "Describe the first day of spring in a small village.",
    "Write a story about an astronaut who hears music on the Moon.",
    "Describe a thunderstorm over the sea.",
    "Write a short story about a lost dog finding its way home.",
    "Describe a forest at night, using all five senses.",
    "Write a story about a baker who can taste people's memories in bread.",
    "Describe a crowded school hallway between classes.",
    "Write a short story about a painter who can only paint in blue.",
    "Describe an abandoned amusement park.",
    "Write a story about a girl who builds a boat to cross a lake.",
    "Describe a winter evening by the fireplace.",
    "Write a short story about a clock that runs backwards.",
    "Describe a desert road at noon.",
    "Write a story about a musician who plays for an empty concert hall.",
    "Describe a bookshop that has been open for a hundred years.",
    "Write a short story about a cat that becomes mayor of a town.",
    "Describe the sounds of a city waking up.",
    "Write a story about a fisherman who catches a talking fish.",
    "Describe a summer picnic that goes wrong.",
    "Write a short story about an inventor whose machine works only on Tuesdays.",
    "Describe a mountain village cut off by snow.",
    "Write a story about two friends who meet again after twenty years.",
    "Describe a museum at night after everyone has left.",
    "Write a short story about a kite that will not come down.",
    "Describe a rainy afternoon in a small cafe.",
    "Write a story about a postman who delivers letters to the past.",
    "Describe a field of sunflowers in late summer.",
    "Write a short story about a girl who can talk to trees.",
    "Describe an island seen from a small plane.",
    "Write a story about a knight who is afraid of the dark.",
    "Describe the inside of a busy train station.",
    "Write a short story about a scientist who shrinks to the size of an ant.",
    "Describe a quiet beach in autumn.",
    "Write a story about a town where it never stops snowing.",
    "Describe a garden after a long drought ends.",
    "Write a short story about a message found in an old photograph.",
    "Describe a night sky far away from any city.",
    "Write a story about a chef cooking for a king who hates food.",
    "Describe a river flowing through a city.",
    "Write a short story about a child's first day at a new school.",
    "Describe a carnival parade from inside the crowd.",
    "Write a story about an old man who repairs broken toys.",
    "Describe the moment a storm ends.",
    "Write a short story about a dragon who collects books instead of gold.",
    "Describe a ship sailing into fog.",
    "Write a story about a family moving to a house by the sea.",
    "Describe a city from the top of its tallest tower.",
    "Write a short story about a bird that cannot fly.",
    "Describe a library during a power cut.",
    "Write a story about a detective solving the case of the missing cake.",
    "Describe the first snowfall of the year in a park.",
    "Write a short story about a violin found in an attic.",
]


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("writing_prompts.jsonl"))
    args = parser.parse_args(argv)
    if len(set(PROMPTS)) != len(PROMPTS):
        raise ValueError("PROMPTS has duplicates")
    args.out.write_text("".join(json.dumps({"id": f"write-{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    print(f"wrote {len(PROMPTS)} prompts to {args.out}")
    return args.out


if __name__ == "__main__":
    main()
