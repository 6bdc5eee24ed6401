"""grpo_parts_adapters (the folder ``adapters/``, see ``[tool.setuptools]`` in pyproject.toml): thin
translation layers that put grpo_parts into training frameworks, one subpackage per framework (``trl``,
``verl``, ``openrlhf``; e.g. ``pip install 'grpo-parts[trl]'``), each importing its framework lazily, so
importing this package never imports TRL, verl or OpenRLHF."""
