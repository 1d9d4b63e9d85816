"""Known models and datasets by name. (Filled in by the real-models work; names pass through.)"""


def resolve_asset(name: str, kind: str) -> str:
    return name
