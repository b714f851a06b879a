"""`phasekv audit`'s body: the pipeline, the engine grid and its checks, the regression gate, the cost of a run.
(`phasekv.audit` itself is the Python function that audits a model object.)"""
