"""The vocabulary of the synthetic demo captions.

Shared by the demo generator (ingest/demo.py) and the tiny tokenizer of the test encoders
(cache/encoders.py), so that tiny text encoders see known words rather than <unk>.
"""

SUBJECTS = [
    "dog",
    "cat",
    "woman",
    "man",
    "child",
    "car",
    "bird",
    "horse",
    "robot",
    "chef",
    "dancer",
    "boat",
    "train",
    "cyclist",
    "musician",
    "fox",
    "elephant",
    "drone",
    "skater",
    "farmer",
]
PLACES = [
    "beach",
    "forest",
    "city street",
    "kitchen",
    "mountain",
    "desert",
    "lake",
    "stadium",
    "market",
    "library",
    "garden",
    "harbor",
    "snowfield",
    "subway station",
    "rooftop",
]
THINGS = [
    "umbrella",
    "lantern",
    "bicycle",
    "guitar",
    "kite",
    "bench",
    "tree",
    "bridge",
    "flag",
    "table",
    "window",
    "cloud",
    "wave",
    "rock",
    "fountain",
    "tower",
    "basket",
    "hat",
    "map",
    "clock",
]
ADJ = ["golden", "misty", "busy", "quiet", "colorful", "snowy", "sunny", "dark", "ancient", "bright"]
VERBS = ["walks through", "runs across", "rests in", "explores", "dances in", "waits at", "crosses"]
CAMERA = ["static", "pan_left", "pan_right", "zoom_in", "zoom_out", "tilt_up"]
