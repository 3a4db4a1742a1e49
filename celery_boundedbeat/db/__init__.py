"""The SQL floor every process stands on: tables, migrations, the store's transactions, the lease."""
