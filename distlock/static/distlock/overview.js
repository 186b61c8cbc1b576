/* The overview page's refresh: fetch the fragment every few seconds and swap it in.
   Plain JavaScript, no library; a failed fetch is shown and retried at the next tick.

   Only a response marked X-Distlock-Fragment is swapped in. A session ended elsewhere
   (a logout in another tab, an expired cookie) makes the fetch a redirect to the login
   page: the panel keeps its last content, the status line says "Signed out — reload to
   sign in", and never "Refreshed". The status line's time is the database clock's, read
   from the fragment (data-now), in the site's zone: the page shows no browser clock. */
"use strict";
(function () {
    const root = document.getElementById("distlock-overview");
    if (!root) {
        return;
    }
    const url = root.dataset.fragmentUrl;
    const seconds = Number(root.dataset.refreshSeconds) || 5;
    const status = document.getElementById("distlock-overview-status");
    let busy = false;

    function say(text, state) {
        status.textContent = text;
        status.dataset.state = state;
        status.classList.toggle("distlock-stale-page", state !== "refreshed");
        root.classList.toggle("distlock-signed-out", state === "signed-out");
    }

    async function refresh() {
        if (busy || document.hidden) {
            return;
        }
        busy = true;
        try {
            // "manual": a redirect (to the login page) is not followed, so the login
            // page is neither fetched nor mistaken for the fragment.
            const response = await fetch(url, {
                credentials: "same-origin", redirect: "manual",
                headers: {"X-Requested-With": "fetch"},
            });
            if (response.type === "opaqueredirect" || response.redirected ||
                    (response.ok && !response.headers.get("X-Distlock-Fragment"))) {
                say("Signed out — reload to sign in.", "signed-out");
                return;
            }
            if (!response.ok) {
                throw new Error("HTTP " + response.status);
            }
            root.innerHTML = await response.text();
            root.dataset.refreshes = String(Number(root.dataset.refreshes || 0) + 1);
            const clock = root.querySelector("[data-now]");
            const at = clock ? clock.dataset.now : "";
            say("Refreshed every " + seconds + " s" + (at ? "; last at " + at : "") + ".",
                "refreshed");
        } catch (error) {
            say("Could not refresh (" + error.message + "); retrying.", "failed");
        } finally {
            // Every finished attempt, whatever its outcome (the tests wait on it).
            root.dataset.checks = String(Number(root.dataset.checks || 0) + 1);
            busy = false;
        }
    }

    window.setInterval(refresh, seconds * 1000);
    document.addEventListener("visibilitychange", refresh);
})();
