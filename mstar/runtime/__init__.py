"""The composition root: starts a conductor and its workers (threads or processes) for a model."""
