// The viewer's only script: pages carry no inline script or handler (the CSP allows script from this
// origin's files alone), and data reaches this file only through data-* attributes, read as text.
//
// A <video data-error-in="ID" data-error-text="..."> that cannot play writes, as text, why into element ID.
// Loaded in <head>, so its listener (capturing: media errors do not bubble) is there before any video.
document.addEventListener(
  "error",
  function (e) {
    var v = e.target;
    if (!(v instanceof HTMLMediaElement) || !v.dataset.errorIn) return;
    var out = document.getElementById(v.dataset.errorIn);
    if (out) out.textContent = v.dataset.errorText + " (media error " + (v.error ? v.error.code : "?") + ")";
  },
  true
);
