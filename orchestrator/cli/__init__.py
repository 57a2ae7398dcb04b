"""The command lines, one job a module: ``auto_launch`` (``auto_launch``, its options in
``launch_arguments``) submits a chain; ``main`` is the ``orchestrator`` program, whose ``status``
(``status_view``) and ``logs`` (``follow_logs``) have modules of their own; ``chain_view`` and
``program`` are what both programs share."""
