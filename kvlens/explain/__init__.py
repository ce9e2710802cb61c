"""Cache patching: which of a policy's removals made the compressed cache get the answer wrong.

`case` builds the full and the compressed cache of one prompt (a task sample or a recorded run's prompt),
`patch` restores the full cache's entries of a group of removals into the compressed cache (or removes one
group from the full cache), `groups` lists the groups (by layer, KV head, position span, decision kind, the
sinks, the needle), `search` scores every patched cache teacher-forced in batches and greedily looks for the
smallest sufficient set. `kvlens explain` (docs/explain.md) and the Why page show the result.
"""
