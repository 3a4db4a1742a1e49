# mypy: allow-subclassing-any, allow-untyped-decorators
"""What every admin page of the package shares: the tables' alias, read-only pages, time fields."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import admin, messages
from django.db import DatabaseError
from django.db.models import Model, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils.safestring import SafeString

from .cells import when, zoned
from .checks import check_tables
from .conf import admin_database


class TablesAdmin(admin.ModelAdmin):
    """Pages over the ``BOUNDEDBEAT_ADMIN_DATABASE`` alias (default ``"default"``)."""

    show_full_result_count = False

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).using(admin_database())

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        """A database without the tables sends the user to the admin index saying what to run."""
        try:
            return super().changelist_view(request, extra_context)
        except DatabaseError:
            problems = check_tables()
            if not problems:
                raise
            for problem in problems:
                self.message_user(request, f"{problem.msg} {problem.hint or ''}", messages.ERROR)
            return HttpResponseRedirect(reverse(f"{self.admin_site.name}:index"))


class ReadOnlyAdmin(TablesAdmin):
    """View-only pages: nobody adds, changes or deletes these rows here."""

    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False


def when_field(field: str, description: str, *, compact: bool = False) -> Callable[[Any, Model], SafeString]:
    """A read-only display of a datetime column with seconds (Django's default drops them).

    On a page the time names its zone; in a list (``compact``) the column's header does.
    """

    @admin.display(description=zoned(description) if compact else description, ordering=field)
    def show(self: Any, obj: Model) -> SafeString:
        return when(getattr(obj, field), compact=compact)

    shown: Callable[[Any, Model], SafeString] = show
    return shown
