"""The commands of ``python -m envace.envs``, one module per group: ``listing`` (list, tasks), ``gold``, ``verify``,
``serve``; ``common`` holds what they share (and ``python -m envace.data`` reuses). Each module's ``add_parsers``
adds its commands to the parser :mod:`envace.envs.__main__` builds."""
