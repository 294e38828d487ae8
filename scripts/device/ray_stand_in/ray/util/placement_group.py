"""ray.util.placement_group of the stand-in."""

from ray import _unavailable


class PlacementGroup:
    pass


placement_group = remove_placement_group = _unavailable
