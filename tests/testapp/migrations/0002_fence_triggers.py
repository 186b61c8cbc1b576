from django.db import migrations

from distlock.fencing.operations import RefuseLowerFenceToken


class Migration(migrations.Migration):

    dependencies = [
        ("testapp", "0001_initial"),
    ]

    operations = [
        RefuseLowerFenceToken("Account"),
        RefuseLowerFenceToken("Order"),
    ]
