"""nodeagent under Ray: inference and elastic training share GPU nodes, with a controller that
lends idle inference devices to training jobs and takes them back when inference wants them.
``docs/cluster.md`` is the deployment guide (docs/internals.md says what each module may import);
``examples/ray_colocate.py`` runs it end to end on one machine.
"""
