/* The overview page's refresh: fetch the fragment every few seconds and swap it in.
   Plain JavaScript, no library; a failed fetch is shown and retried at the next tick. */
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

    async function refresh() {
        if (busy || document.hidden) {
            return;
        }
        busy = true;
        try {
            const response = await fetch(url, {
                credentials: "same-origin", headers: {"X-Requested-With": "fetch"},
            });
            if (!response.ok) {
                throw new Error("HTTP " + response.status);
            }
            root.innerHTML = await response.text();
            root.dataset.refreshes = String(Number(root.dataset.refreshes || 0) + 1);
            status.textContent = "Refreshed every " + seconds + " s; last at " +
                new Date().toLocaleTimeString() + ".";
            status.classList.remove("distlock-stale-page");
        } catch (error) {
            status.textContent = "Could not refresh (" + error.message + "); retrying.";
            status.classList.add("distlock-stale-page");
        } finally {
            busy = false;
        }
    }

    window.setInterval(refresh, seconds * 1000);
    document.addEventListener("visibilitychange", refresh);
})();
