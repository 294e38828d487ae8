"""ray._private.utils of the stand-in."""


def read_ray_address(*args, **kwargs):
    return None
