%% @private
%% The bound on a peer node's partial messages in pieces (`max_reassembly_bytes'),
%% shared by this node's inboxes, and the only module touching it.
%%
%% A node's messages in pieces reach whichever inbox their senders' lanes use,
%% so every inbox may hold partials of the same node. Per node, a row of the
%% public table `convoy_reassembly' (created by `convoy_inbox_sup', which
%% outlives its inboxes) holds an `atomics' array: one slot per inbox, the bytes
%% its partials of that node reserve, written only by that inbox (through this
%% module, in the inbox's process), and one more slot, the mark of a row being
%% forgotten.
%%
%% Taking room (a start): the inbox decides against the room the other inboxes
%% leave (`room/2'), writes its new total to its slot, then reads the slots and
%% the mark (`reserve/3'): it keeps the start only if the sum is within the bound
%% and the row is not being forgotten, else it writes its old total back and
%% refuses. Atomic operations are mutually ordered, so of two inboxes claiming
%% at once the one that reads last sees both claims: both may refuse, never
%% both keep, and a node's reserved bytes never exceed the bound. Giving room
%% back is one write (`release/2').
%%
%% A restarted inbox holds nothing: it zeroes its slot in every row
%% (`join/2'), so what its previous run reserved goes with it.
%%
%% Forgetting a node that is gone (`forget/1', by each inbox at the node's
%% nodedown): the row is deleted if every slot is 0. The forgetter raises the
%% mark before it reads the slots (counted, so that two forgetters do not clear
%% each other's) and lowers it if it keeps the row; a claimer reads the mark
%% after its claim, so a row is never deleted under a reservation. The inbox
%% keeps the rows it reserves bytes in (in its process dictionary): a row is
%% never deleted while one of its slots is not 0.
-module(convoy_chunk_bound).

-export([new_table/0, join/2, room/2, reserve/3, release/2, nodes/0, forget/1, reserved/1]).

-define(TABLE, convoy_reassembly).
%% In the inbox's process dictionary: its index and the number of inboxes, and
%% the rows it reserves bytes in with what it reserves there.
-define(INBOX_KEY, '$convoy_chunk_inbox').
-define(ROWS_KEY, '$convoy_chunk_rows').

-type bound() :: pos_integer() | infinity.

%% @doc Create the table (by its owner, `convoy_inbox_sup').
-spec new_table() -> ok.
new_table() ->
    _ = ets:new(?TABLE, [named_table, public, set, {read_concurrency, true}]),
    ok.

%% @doc The calling process is inbox `Index' of `Inboxes', (re)started: it
%% reserves nothing.
-spec join(pos_integer(), pos_integer()) -> ok.
join(Index, Inboxes) ->
    put(?INBOX_KEY, {Index, Inboxes}),
    erase(?ROWS_KEY),
    ets:foldl(fun({_Node, Slots}, ok) -> atomics:put(Slots, Index, 0) end, ok, ?TABLE).

%% @doc The bytes this inbox may reserve for `Node''s partials, its own included:
%% `Bound' less what the other inboxes reserve.
-spec room(node(), bound()) -> non_neg_integer() | infinity.
room(_Node, infinity) ->
    infinity;
room(Node, Bound) ->
    Slots = row(Node),
    max(0, Bound - (sum(Slots) - atomics:get(Slots, index()))).

%% @doc This inbox's reservation for `Node' becomes `Held' bytes (more than
%% before) if the node's reservations in all inboxes stay within `Bound': true;
%% otherwise false, and nothing changed.
-spec reserve(node(), non_neg_integer(), bound()) -> boolean().
reserve(Node, Held, Bound) ->
    Slots = row(Node),
    Old = mine(Node),
    set(Node, Slots, Held),
    case atomics:get(Slots, mark(Slots)) =:= 0 andalso fits(sum(Slots), Bound) of
        true ->
            true;
        false ->
            set(Node, Slots, Old),
            false
    end.

fits(_Bytes, infinity) -> true;
fits(Bytes, Bound) -> Bytes =< Bound.

%% @doc This inbox's reservation for `Node' becomes `Held' bytes, no more than
%% before.
-spec release(node(), non_neg_integer()) -> ok.
release(Node, Held) ->
    case rows() of
        #{Node := {_Slots, Held}} -> ok;
        #{Node := {Slots, _}} -> set(Node, Slots, Held);
        _ -> ok % it reserves nothing there
    end.

%% @doc The nodes this inbox reserves bytes for.
-spec nodes() -> [node()].
nodes() ->
    maps:keys(rows()).

%% @doc `Node' is gone: its row is deleted if no inbox reserves anything in it.
-spec forget(node()) -> ok.
forget(Node) ->
    case ets:lookup(?TABLE, Node) of
        [{_, Slots} = Row] ->
            Mark = mark(Slots),
            atomics:add(Slots, Mark, 1),
            case sum(Slots) of
                0 ->
                    true = ets:delete_object(?TABLE, Row),
                    ok;
                _ ->
                    atomics:sub(Slots, Mark, 1)
            end;
        [] ->
            ok
    end.

%% @doc Bytes reserved for `Node''s partial messages in all inboxes (for tests
%% and inspection, from any process).
-spec reserved(node()) -> non_neg_integer().
reserved(Node) ->
    case ets:lookup(?TABLE, Node) of
        [{_, Slots}] -> sum(Slots);
        [] -> 0
    end.

row(Node) ->
    case rows() of
        #{Node := {Slots, _}} -> Slots;
        _ -> lookup(Node)
    end.

lookup(Node) ->
    case ets:lookup(?TABLE, Node) of
        [{_, Slots}] ->
            Slots;
        [] ->
            {_, Inboxes} = get(?INBOX_KEY),
            Slots = atomics:new(Inboxes + 1, [{signed, false}]),
            case ets:insert_new(?TABLE, {Node, Slots}) of
                true -> Slots;
                false -> lookup(Node) % another inbox made it first
            end
    end.

set(Node, Slots, Held) ->
    atomics:put(Slots, index(), Held),
    Rows = rows(),
    put(?ROWS_KEY, case Held of
                       0 -> maps:remove(Node, Rows);
                       _ -> Rows#{Node => {Slots, Held}}
                   end),
    ok.

mine(Node) ->
    case rows() of
        #{Node := {_, Held}} -> Held;
        _ -> 0
    end.

rows() ->
    case get(?ROWS_KEY) of
        undefined -> #{};
        Rows -> Rows
    end.

index() ->
    {Index, _} = get(?INBOX_KEY),
    Index.

%% The slots of the inboxes come first; the mark is the last one.
mark(Slots) ->
    maps:get(size, atomics:info(Slots)).

sum(Slots) ->
    lists:sum([atomics:get(Slots, I) || I <- lists:seq(1, mark(Slots) - 1)]).
