// The sign-in page: trades a bearer token for the console's HttpOnly session cookie.
// It never stores the token itself (no localStorage, no readable cookie): the server sets it.

const form = document.getElementById("signin-form");
const input = document.getElementById("token");
const error = document.getElementById("signin-error");

function next() {
  // Only a hash route of the console itself: never an address another site could name.
  const wanted = new URLSearchParams(location.search).get("next") || "";
  return /^#\/[A-Za-z0-9_\-/.]*$/.test(wanted) ? wanted : "#/timeline";
}

function say(text) {
  error.textContent = text;
  error.hidden = false;
}

form.addEventListener("submit", async (event) => {
  event.preventDefault();
  error.hidden = true;
  const token = input.value.trim();
  if (!token) {
    say("Paste a token first.");
    return;
  }
  let answer;
  try {
    answer = await fetch("/console/session", {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-Better-Compute": "1" },
      body: JSON.stringify({ token }),
    });
  } catch {
    say("The server did not answer. Is it running? Try again in a moment.");
    return;
  }
  if (answer.ok) {
    input.value = "";
    location.assign("/console/" + next());
    return;
  }
  if (answer.status === 401 || answer.status === 403) {
    say("That token was not accepted. Check it was copied whole; `better-compute dev` prints the demo's tokens.");
  } else {
    let message = `The server refused the sign-in (HTTP ${answer.status}).`;
    try {
      const body = await answer.json();
      if (body && body.error && body.error.message) message += " " + body.error.message;
    } catch {
      // Not JSON: the status says enough.
    }
    say(message);
  }
});

input.focus();
