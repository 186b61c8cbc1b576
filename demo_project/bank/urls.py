from __future__ import annotations

from django.urls import path

from demo_project.bank import views

app_name = "bank"
urlpatterns = [path("accounts/<int:pk>/", views.account, name="account")]
