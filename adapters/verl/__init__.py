"""grpo_parts as a verl 0.9.1 plugin (``pip install -e '.[verl]'``, plus ``pip install --no-deps
verl==0.9.1``). Importing this package imports nothing from verl; importing :mod:`.plugin` registers
every part with verl's own registries (docs/adapters/verl.md: the overrides, scaling across workers)."""

PLUGIN_MODULE = "grpo_parts_adapters.verl.plugin"

__all__ = ["PLUGIN_MODULE"]
