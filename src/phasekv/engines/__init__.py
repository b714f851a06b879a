"""A model as an inference engine serves it: one file per engine (its API, launcher, settings, self-report and
prompt-cache policy), found by name through `registry.py`; the wire, the process plumbing, the answers' checks, the
journal and the adapter of a served model beside them."""
