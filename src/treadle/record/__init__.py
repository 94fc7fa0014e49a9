"""The run record: what a run leaves in its folder, and who may write there.

- ``record.runfiles``: THE run folder's record files (metrics.jsonl, completions.jsonl, training_args.json,
  run.json) and their one cut-line policy;
- ``record.fingerprints``: a checkpoint's marker file (the digests of its files), the dataset's fingerprint and
  the fingerprint of the settings that shape a run;
- ``record.runs``: a run folder belongs to one run: its checks, the lock, ``overwrite_output_dir``;
- ``record.describe``: what made a run besides its arguments (model, datasets, reward functions, LoRA), for run.json;
- ``record.plots``: the PNG plots of a run's metrics;
- ``record.trackers``: ``report_to``: transformers' tracker callbacks, completions tables and plots;
- ``record.report``: a run's summary, report.html and overlays (``treadle report``; the run side).

The rooms sit at different layers (docs/architecture.md): the files, fingerprints, the folder's claim and the plots
sit below the loop, which writes them; ``describe`` reads models and datasets; ``trackers`` are callbacks; the
report is the command line's.
"""
