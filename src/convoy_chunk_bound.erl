%% @private
%% The bound on a peer node's partial messages in pieces (`max_reassembly_bytes'),
%% shared by this node's inboxes: the only module touching its table (the
%% arrays in it are `convoy_held''s).
%%
%% A node's messages in pieces reach whichever inbox their senders' lanes use,
%% so every inbox may hold partials of the same node. Per node, a row of the
%% public table `convoy_reassembly' (created by `convoy_inbox_sup', which
%% outlives its inboxes) holds the node's shares (`convoy_held:shares()'): one
%% per inbox, the bytes its partials of that node reserve, written only by that
%% inbox (through this module, in the inbox's process), and the mark of a row
%% being forgotten.
%%
%% Taking room (a start): the inbox decides against the room the other inboxes
%% leave (`room/3'), then claims its new total (`reserve/5'): it keeps the start
%% only if the shares stay within the bound and the row is not being forgotten,
%% else its share is put back and it refuses (`convoy_held:claim_share/5': of
%% two inboxes claiming at once both may refuse, never both keep, and a node's
%% reserved bytes never exceed the bound). Giving room back is one write
%% (`release/3').
%%
%% A restarted inbox holds nothing: it zeroes its slot in every row
%% (`join/2'), so what its previous run reserved goes with it.
%%
%% Forgetting a node that is gone (`forget/1', by each inbox at the node's
%% nodedown): the row is deleted if no inbox reserves anything in it. The
%% forgetter raises the mark before it reads the shares and lowers it if it
%% keeps the row (`convoy_held:try_close_shares/1'); a claimer reads the mark
%% after its claim, so a row is never deleted under a reservation, and an inbox
%% that reserves bytes in a row always finds it.
%%
%% What an inbox reserves per node is its core's to know (`convoy_inbox_core'):
%% the inbox names its slot (`slot()') and the bytes in every call.
-module(convoy_chunk_bound).

-export([new_table/0, join/2, room/3, reserve/5, release/3, forget/1, reserved/1]).

-export_type([slot/0, bound/0]).

-define(TABLE, convoy_reassembly).

-type bound() :: pos_integer() | infinity.
%% An inbox's slot: its index and the number of inboxes.
-opaque slot() :: {pos_integer(), pos_integer()}.

%% @doc Create the table (by its owner, `convoy_inbox_sup').
-spec new_table() -> ok.
new_table() ->
    _ = ets:new(?TABLE, [named_table, public, set, {read_concurrency, true}]),
    ok.

%% @doc Inbox `Index' of `Inboxes', (re)started: its slot, reserving nothing.
-spec join(pos_integer(), pos_integer()) -> slot().
join(Index, Inboxes) ->
    ok = ets:foldl(fun({_Node, Shares}, ok) -> convoy_held:set_share(Shares, Index, 0) end,
                   ok, ?TABLE),
    {Index, Inboxes}.

%% @doc The bytes this inbox may reserve for `Node''s partials, its own included:
%% `Bound' less what the other inboxes reserve.
-spec room(slot(), node(), bound()) -> non_neg_integer() | infinity.
room(_Slot, _Node, infinity) ->
    infinity;
room({Index, _} = Slot, Node, Bound) ->
    max(0, Bound - convoy_held:others_share(row(Slot, Node), Index)).

%% @doc This inbox's reservation for `Node' becomes `Held' bytes (more than
%% `Old', what it reserves now) if the node's reservations in all inboxes stay
%% within `Bound': true; otherwise false, and nothing changed.
-spec reserve(slot(), node(), non_neg_integer(), non_neg_integer(), bound()) -> boolean().
reserve({Index, _} = Slot, Node, Old, Held, Bound) ->
    convoy_held:claim_share(row(Slot, Node), Index, Old, Held, Bound).

%% @doc This inbox's reservation for `Node' becomes `Held' bytes, no more than
%% before.
-spec release(slot(), node(), non_neg_integer()) -> ok.
release({Index, _}, Node, Held) ->
    case ets:lookup(?TABLE, Node) of
        [{_, Shares}] -> convoy_held:set_share(Shares, Index, Held);
        [] -> ok % it reserves nothing there
    end.

%% @doc `Node' is gone: its row is deleted if no inbox reserves anything in it.
-spec forget(node()) -> ok.
forget(Node) ->
    case ets:lookup(?TABLE, Node) of
        [{_, Shares} = Row] ->
            _ = convoy_held:try_close_shares(Shares) andalso ets:delete_object(?TABLE, Row),
            ok;
        [] ->
            ok
    end.

%% @doc Bytes reserved for `Node''s partial messages in all inboxes (for tests
%% and inspection, from any process).
-spec reserved(node()) -> non_neg_integer().
reserved(Node) ->
    case ets:lookup(?TABLE, Node) of
        [{_, Shares}] -> convoy_held:shares(Shares);
        [] -> 0
    end.

row({_, Inboxes} = Slot, Node) ->
    case ets:lookup(?TABLE, Node) of
        [{_, Shares}] ->
            Shares;
        [] ->
            Shares = convoy_held:new_shares(Inboxes),
            case ets:insert_new(?TABLE, {Node, Shares}) of
                true -> Shares;
                false -> row(Slot, Node) % another inbox made it first
            end
    end.
