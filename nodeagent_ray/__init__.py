"""nodeagent under Ray: inference and elastic training share GPU nodes, with a controller
that lends idle inference devices to training jobs and takes them back when inference
wants them. ``docs/cluster.md`` is the deployment guide; ``examples/ray_colocate.py``
runs it end to end on one machine.

Modules, and what each may import:

- :mod:`nodeagent_ray.policy`: the controller's decisions, pure (no I/O, no Ray).
- :mod:`nodeagent_ray.policies`: the policies it may run, by name (Tiresias, knapsack
  lending, deadline-first), pure as well; ``bench.cluster_sim`` drives them on a trace.
- :mod:`nodeagent_ray.core`: the controller's loop: every node's inventory and events
  through :class:`client_lib.placement.PlacementClient`, the policy, and the loans
  carried out through interfaces it is given (no Ray, so it is tested with fakes).
- :mod:`nodeagent_ray.raynode`: a Ray node as a process we started and stop by pid.
- :mod:`nodeagent_ray.actors`: the Ray side: the controller actor, one loan agent per
  GPU node (starts and stops loan nodes), the training job's tracker. Imports ray.
- :mod:`nodeagent_ray.train`: what a Ray Train worker on a lent device runs: its
  session, parking and the hand-off of its state at a reclaim or a resize.

Importing this package imports nothing of Ray; ``pip install nodeagent[ray]`` brings it.
"""
