"""The config machinery of the drivers, free of torch: the RL run's config (``rl``), its algorithm section
(``algorithm``), the SFT / RM run configs (``supervised``), the YAML loader (``loader``) and the generator of
docs/config.md (``docs``). Import from the submodules; this package imports nothing by itself."""
