"""envace's verl layer: everything that plugs into verl's trainer, in one place.

=========================  =====================================================================================
module                     what it plugs in, and where in verl
=========================  =====================================================================================
:mod:`.plugin`             the ``verl.plugins`` entry point (``pyproject.toml``): verl imports it on ``import verl``
:mod:`.extensions`         the registrations: CPU platform (every process); ``grpo_rolewise`` estimator
                           (``register_adv_est``) and the trainers (``register_trainer``) in the TaskRunner process
:mod:`.trainers`           the trainers (``register_trainer``): ``envace_{sync,colocate_async,separate_async}``,
                           verl's V1 trainers + role labels, per-role and staleness metrics, role-tagged dumps;
                           ``envsched_*``: the same with EnvSched choosing every prompt (TaskRunner process only)
:mod:`.trainer`            the trainers' verl-free parts: row labels, metrics, held-out validation
:mod:`.observation_loss`   ECHO's observation loss beside verl's ``ppo_loss``: the actor's loss function
                           (``set_loss_fn``), installed by the trainers after verl's ``init``
:mod:`.sched`              EnvSched's verl-free parts: the scheduler from the dataset, reward groups, its state file
:mod:`.runner`             verl's V1 TaskRunner with the registrations, ``run_ppo``, the Ray runtime environment
:mod:`.config`             the training config verl reads (``configs/envace_trainer.yaml``) and verl's own checks
:mod:`.resume`             which of verl's checkpoints a resumed run loads (complete ones only)
=========================  =====================================================================================

The agent loops are registered through verl's agent-loop config file (``envace/agents/agent_loops.yaml``), and the
CPU device backend verl runs on without CUDA is :mod:`envace.platform`. The private verl methods the trainers
override are pinned, with their signatures, by ``tests/envace/verl/test_verl_pins.py``.

This package's ``__init__`` imports nothing: verl imports :mod:`.plugin` while ``verl/__init__`` is still loading.
"""
