"""grpo_parts_adapters: thin translation layers that put grpo_parts into training frameworks.

The folder ``adapters/`` of the repository is installed as the package ``grpo_parts_adapters``
(see ``[tool.setuptools]`` in pyproject.toml); one subpackage per framework, each importing its
framework lazily, so importing this package never imports TRL, verl or OpenRLHF.

* ``grpo_parts_adapters.trl`` -- TRL 1.16 ``GRPOTrainer`` (``pip install -e '.[trl]'`` in a checkout,
  ``pip install 'grpo-parts[trl]'`` by name)
"""
