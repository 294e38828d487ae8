"""ray.util.scheduling_strategies of the stand-in."""


class PlacementGroupSchedulingStrategy:
    def __init__(self, *args, **kwargs) -> None:
        pass
