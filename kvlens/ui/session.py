"""Session-state keys that more than one module reads or writes, declared once.

A widget key used by one page only stays in that page; a page's job flags are derived from its
prefix by `kvlens.ui.jobs.PageJob` (`{prefix}_running`, `{prefix}_stopped`).
"""

SHELL = "app_shell_active"  # app.py is drawing the shell (page config, sidebar) around the page
RUN = "app_run"  # the sidebar's run picker: a run directory
RUN_ENTRY = "app_run_entry"  # the picked run's `RunEntry` (None: there are no runs)
RUN_REQUEST = "app_run_request"  # a run directory a page saved, selected on the next rerun
PAPER = "app_paper"  # charts shown in the paper style
MODEL = "app_model"  # the model spec of the Run and Compare pages
DEVICE = "app_device"
