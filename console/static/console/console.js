// Behaviour every console page shares: a confirmation before destructive writes, and copy buttons.
"use strict";
// <form data-confirm="Revoke sk-ab12_…?">: nothing is sent unless the operator confirms.
document.addEventListener("submit", (event) => {
  const question = event.target.dataset && event.target.dataset.confirm;
  if (question && !window.confirm(question)) event.preventDefault();
}, true);

// <button data-copy="element-id">: copies that element's text. The Clipboard API needs a
// secure context (https or localhost); elsewhere the text is selected and copied the old way.
document.addEventListener("click", async (event) => {
  const button = event.target.closest("button[data-copy]");
  if (!button) return;
  const source = document.getElementById(button.dataset.copy);
  try {
    await navigator.clipboard.writeText(source.textContent);
  } catch (err) {
    window.getSelection().selectAllChildren(source);
    document.execCommand("copy");
  }
  button.textContent = "Copied";
  const status = document.getElementById(`${button.dataset.copy}-status`);  // a live region says so to screen readers
  if (status) status.textContent = "Copied to the clipboard.";
});
