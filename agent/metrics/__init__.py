"""The agent's metrics as typed objects.

`family` declares what a metric is (name, kind, labels, help, unit; checked against the naming
conventions when it is declared), `state` stores the series of every family. Each concern declares
the families it writes in its own module (`connections`, `actions`, `groups`, `windows`, `jobs`,
`identity`); agent/catalog.py lists them all, in exposition order, and agent/exporters.py renders
them. A writer imports the family it writes, so a misspelt metric fails when its module is imported.
"""
