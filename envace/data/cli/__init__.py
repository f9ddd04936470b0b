"""The commands of ``python -m envace.data``, one module per group: ``parquet`` (build, convert-cm2), ``traces``
(record-traces). They share the exit codes, the error and ``--pool-kwargs`` of ``python -m envace.envs``
(:mod:`envace.envs.cli.common`); each module's ``add_parsers`` adds its commands to the parser
:mod:`envace.data.__main__` builds."""
