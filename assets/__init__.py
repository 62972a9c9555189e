"""Dagster asset definitions, checks, jobs, sensors and schedules of tinker-pipelines."""
