defmodule ElixirDemo.Tally do
  @moduledoc """
  A plain GenServer that keeps what it is cast, in order. Nothing in it knows
  about convoy: other nodes cast and call it with `:convoy.cast/2` and
  `:convoy.call/2,3` (the requests travel in convoy's batches) exactly as they
  would with `GenServer.cast/2` and `GenServer.call/2`.

      {:ok, _} = ElixirDemo.Tally.start(name: ElixirDemo.Tally)
      # on another node:
      :ok = :convoy.cast({ElixirDemo.Tally, :"b@host"}, {:add, 1})
      [1] = :convoy.call({ElixirDemo.Tally, :"b@host"}, :all)
  """
  use GenServer

  @doc "Starts a tally (unlinked, e.g. on another node); GenServer options."
  def start(opts \\ []), do: GenServer.start(__MODULE__, [], opts)

  @impl true
  def init(items), do: {:ok, items}

  @impl true
  def handle_cast({:add, item}, items), do: {:noreply, [item | items]}

  @impl true
  def handle_call(:all, _from, items), do: {:reply, Enum.reverse(items), items}

  # Answers later, with GenServer.reply/2, then tells `owner` it did.
  def handle_call({:late, ms, owner}, from, items) do
    Process.send_after(self(), {:answer, from, owner}, ms)
    {:noreply, items}
  end

  @impl true
  def handle_info({:answer, from, owner}, items) do
    GenServer.reply(from, :late)
    send(owner, :replied)
    {:noreply, items}
  end
end
