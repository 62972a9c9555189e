"""The loops that drive the engines: the stages of an experiment (`experiment`), the plain
loop (`train`), DPO (`dpo`, `preferences`), self-play (`multiagent`), batch inference
(`inference`), resume after a crash (`run_dir`) and episodes as datums (`datums`)."""
