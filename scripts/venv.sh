# Sourced by scripts/test and scripts/demo: makes $VENV (default .venv) with the project
# installed in editable mode. PYTHON picks the interpreter; DJANGO pins Django (e.g.
# "Django>=6.0,<6.2"); DISTLOCK_EXTRAS adds extras. Reinstalls only when one of these or
# pyproject.toml changed, so a second run starts at once.
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
DJANGO=${DJANGO:-}
extras="dev,postgresql,celery${DISTLOCK_EXTRAS:+,$DISTLOCK_EXTRAS}"

stamp="$VENV/.distlock-installed"
want="$("$PYTHON" --version 2>&1) $extras $DJANGO $(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "installing django-distlock[$extras] ${DJANGO} into $VENV"
    if [ ! -f "$stamp" ]; then
        echo "  (first run: pip downloads Django, Celery, psycopg and the test tools;" \
             "a minute or two, quietly)"
    fi
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        -e ".[$extras]" ${DJANGO:+"$DJANGO"} || {
        # The stamp is written only after a whole install: a failed one (a package that
        # did not build) is tried again on the next run, not taken as done.
        echo "pip could not install django-distlock[$extras] into $VENV" >&2
        return 1
    }
    echo "$want" > "$stamp"
    echo "  installed; next runs start at once"
fi
